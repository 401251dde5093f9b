"""A stage's code cannot change behind its cache: the digest of the source every stage runs is
recorded beside its code version, and a change to either without the other fails here."""

import json

from tests.code_versions import TABLE, table


def test_every_stage_code_change_comes_with_a_decision_about_its_code_version():
    recorded, current = json.loads(TABLE.read_text()), table()
    problems = []
    for stage, now in current.items():
        before = recorded.get(stage)
        if before is None:
            problems.append(f"{stage} is new: record it")
            continue
        changed = sorted(
            m
            for m in now["modules"].keys() | before["modules"].keys()
            if now["modules"].get(m) != before["modules"].get(m)
        )
        if changed and now["code_version"] == before["code_version"]:
            problems.append(
                f"the code of {stage} changed ({', '.join(changed)}): bump the code version of {stage} "
                f"in tasks/registry.py if what it builds for the same inputs changes, then record"
            )
        elif now["code_version"] != before["code_version"] and not changed:
            problems.append(f"{stage}'s code version changed: record it")
        elif changed:
            problems.append(f"{stage}'s code version was bumped: record the new digests")
    assert not problems, "\n".join(problems) + "\nrecord with: python -m tests.code_versions"


def test_the_digest_ignores_comments_and_docstrings_but_not_code(tmp_path, monkeypatch):
    from tests import code_versions

    package = tmp_path / "thingpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = package / "thing.py"
    monkeypatch.setattr(code_versions, "REPO", tmp_path)
    monkeypatch.setattr(code_versions, "OWN_PACKAGES", {"thingpkg"})
    monkeypatch.syspath_prepend(str(tmp_path))
    source.write_text('"""A docstring."""\n\ndef f(x):\n    return x + 1  # a comment\n')
    first = code_versions.digests("thingpkg.thing")
    assert list(first) == ["thingpkg.thing"]  # found where Python finds it
    source.write_text('"""Another docstring."""\n\n\ndef f(x):\n    """Adds one."""\n    return x + 1\n')
    assert code_versions.digests("thingpkg.thing") == first
    source.write_text("def f(x):\n    return x + 2\n")
    assert code_versions.digests("thingpkg.thing") != first
