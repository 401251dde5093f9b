"""A message when it matters: ``bardflow notify add URL`` makes the server send one when a
pipeline run fails (naming the run, the stage and the one-line error), when a run crashes
(its process killed, its host gone), and when a sweep finishes (its best row, as a ready
``--set`` line), each with a link to the run in the UI.

It is Prefect's own machinery, kept on the server so that it works for every run that
reports there, a worker's included: a notification block (a Custom Webhook for an http(s)
URL, a Slack Webhook for a Slack one, or any notification block made in the UI) and three
automations. A failure and a finished sweep are bardflow events that the flows emit with
what the message needs; a crash is Prefect's own ``Crashed`` state, which nothing in a
killed process can report, so the server's automation is the one that notices.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, cast
from uuid import UUID

from ..errors import BardflowError

RUN_FAILED = "bardflow.run.failed"
SWEEP_FINISHED = "bardflow.sweep.finished"
FLOWS = ("bardflow-pipeline", "bardflow-samples", "bardflow-sweep")
PREFIX = "bardflow-notify"

MESSAGES = {  # (what triggers it, subject, body): Prefect's templates, filled in on the server
    "failed": (
        RUN_FAILED,
        "bardflow: {{ flow_run.name }} failed in {{ event.payload.stage }}",
        (
            "bardflow run {{ flow_run.name }} ({{ event.payload.flow }}) failed in stage "
            "{{ event.payload.stage }}: {{ event.payload.error }}\n{{ flow_run|ui_url }}"
        ),
    ),
    "crashed": (
        "prefect.flow-run.Crashed",
        "bardflow: {{ flow_run.name }} crashed",
        (
            "bardflow run {{ flow_run.name }} ({{ flow.name }}) crashed: {{ flow_run.state.message }}\n"
            "{{ flow_run|ui_url }}"
        ),
    ),
    "sweep": (
        SWEEP_FINISHED,
        "bardflow: sweep {{ flow_run.name }} finished",
        (
            "bardflow sweep {{ flow_run.name }} finished: {{ event.payload.summary }}\n"
            "best: {{ event.payload.best }}\n{{ flow_run|ui_url }}"
        ),
    ),
}


class NotifyError(BardflowError, ValueError):
    """A destination that cannot be used, or a name that is not there."""


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")


def _block_for(url: str, name: str):
    """The notification block that posts to ``url``: Slack's format for a Slack webhook,
    else a JSON body with the subject, the body and both as ``text`` (Slack, Mattermost and
    most chat webhooks show that field)."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock, SlackWebhook
    from pydantic import SecretStr

    if re.match(r"https://hooks\.slack\.com/", url):
        return SlackWebhook(url=SecretStr(url))
    if not re.match(r"https?://[^/\s]+", url):
        raise NotifyError(
            f"{url!r} is not an http(s) webhook URL; for e-mail, Teams, PagerDuty and the other "
            "services make a notification block in the Prefect UI (Blocks) and pass "
            "--block TYPE/NAME"
        )
    return CustomWebhookNotificationBlock(
        name=name,
        url=url,
        headers=None,
        cookies=None,
        json_data={"subject": "{{subject}}", "body": "{{body}}", "text": "{{subject}}\n{{body}}"},
    )


def add(url: str | None, name: str, block: str | None = None) -> list[str]:
    """A destination for every message; returns the automations' names."""
    from prefect.automations import AutomationCore, EventTrigger, Posture, SendNotification
    from prefect.blocks.core import Block
    from prefect.client.orchestration import get_client

    name = _slug(name)
    if not name:
        raise NotifyError("--name needs letters or digits")
    remove(name, missing_ok=True)  # adding again replaces
    if block is not None:
        kind, _, saved = block.partition("/")
        if not saved:
            raise NotifyError(
                f"--block expects TYPE/NAME as the UI's Blocks page shows it, e.g. slack-webhook/alerts; got {block!r}"
            )
        from prefect.blocks.abstract import NotificationBlock

        try:
            document = cast(Block, Block.load(f"{kind}/{saved}"))  # the synchronous call's result
        except ValueError as error:
            raise NotifyError(f"no block {block} on this server ({error}); make it in the UI (Blocks)") from None
        if not isinstance(document, NotificationBlock):
            raise NotifyError(
                f"block {block} sends no notifications; name a notification block (Slack, Teams, "
                "e-mail, a custom webhook, …)"
            )
        block_id = document._block_document_id
        if block_id is None:
            raise NotifyError(f"block {block} has no saved document on this server; save it in the UI (Blocks)")
    else:
        block_id = cast(UUID, _block_for(url or "", name).save(f"{PREFIX}-{name}", overwrite=True))  # synchronous
    created = []
    with get_client(sync_client=True) as client:
        for what, (event, subject, body) in MESSAGES.items():
            # Prefect's own state events: bardflow's flows only (its own events are bardflow's).
            related = {"prefect.resource.role": "flow", "prefect.resource.name": list(FLOWS)}
            trigger = EventTrigger(
                expect={event},
                posture=Posture.Reactive,
                threshold=1,
                match_related=related if event.startswith("prefect.") else {},
            )
            automation = AutomationCore(
                name=f"{PREFIX}-{name}-{what}",
                description=f"bardflow notify: {what} runs",
                trigger=trigger,
                actions=cast(list[Any], [SendNotification(block_document_id=block_id, subject=subject, body=body)]),
            )
            client.create_automation(automation)
            created.append(automation.name)
    return created


def listed() -> list[dict[str, Any]]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        automations = client.read_automations()
    rows = {}
    for automation in automations:
        found = re.fullmatch(rf"{PREFIX}-(.+)-({'|'.join(MESSAGES)})", automation.name)
        if found:
            row = rows.setdefault(found.group(1), {"name": found.group(1), "messages": [], "enabled": True})
            row["messages"].append(found.group(2))
            row["enabled"] = row["enabled"] and automation.enabled
    return list(rows.values())


def remove(name: str, missing_ok: bool = False) -> int:
    """Removes a destination's automations (and the block ``add`` made for it)."""
    from prefect.blocks.core import Block
    from prefect.client.orchestration import get_client

    name = _slug(name)
    removed = 0
    with get_client(sync_client=True) as client:
        for what in MESSAGES:
            for automation in client.read_automations_by_name(f"{PREFIX}-{name}-{what}"):
                client.delete_automation(automation.id)
                removed += 1
        for kind in ("custom-webhook", "slack-webhook"):
            try:
                made = cast(Block, Block.load(f"{kind}/{PREFIX}-{name}"))
            except ValueError:
                continue
            if made._block_document_id is not None:
                client.delete_block_document(made._block_document_id)
    if not removed and not missing_ok:
        raise NotifyError(f"no notification named {name!r}; `bardflow notify list` shows them")
    return removed


def emit(event: str, payload: Mapping[str, object]) -> None:
    """A bardflow event about the current flow run, which the automations above turn into a
    message (and the UI's event feed shows either way)."""
    from prefect.events import emit_event
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    emit_event(
        event=event,
        resource={
            "prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
            "prefect.resource.name": flow_run.name or "",
        },
        payload={"flow": flow_run.flow_name, **payload},
    )
