"""How a training state is laid out over a mesh: one rule table from the parameters' logical
axes (``model/network/parameters.py``) to mesh axes, by layout. Placement, the compiled step and
the memory estimate all ask ``mesh_axes``. Plain Python: the memory estimate reads it before
JAX is imported."""

from __future__ import annotations

import math

from ..network.parameters import LOGICAL_AXES, axes_of

DATA_AXIS = "data"  # the data-parallel mesh axis: batches are split over it, and FSDP's state

# The mesh axis each logical axis may be split over, by layout (the rules are data, as
# MaxText's logical axis rules are). FSDP (ZeRO-3) may split any axis over the data axis: of
# the dimensions a rule allows, ``mesh_axes`` takes one. A tensor-parallel layout would add a
# ``model`` axis for ``qkv``, ``heads`` and ``mlp``.
RULES: dict[str, dict[str, str]] = {
    "single": {},
    "replicated": {},
    "fsdp": dict.fromkeys(LOGICAL_AXES, DATA_AXIS),
}
# Arrays below this many elements (biases, norms) stay whole on every device under FSDP:
# splitting them saves little and adds a collective each.
MIN_SPLIT_ELEMENTS = 1 << 14


def mesh_axes(
    axes: tuple[str, ...], shape: tuple[int, ...], layout: str, mesh: dict[str, int]
) -> tuple[str | None, ...]:
    """Each dimension's mesh axis (None: whole) for an array of logical ``axes`` and ``shape``
    under ``layout``, on a mesh of ``mesh`` devices by axis name. Each mesh axis takes one
    dimension: the largest its devices divide of those the rule lets it have (the first of
    equal ones); an array below ``MIN_SPLIT_ELEMENTS`` stays whole."""
    chosen: list[str | None] = [None] * len(shape)
    if math.prod(shape) < MIN_SPLIT_ELEMENTS:
        return tuple(chosen)
    rule = RULES[layout]
    for mesh_axis, devices in mesh.items():
        allowed = [
            dim
            for dim, (axis, size) in enumerate(zip(axes, shape, strict=True))
            if devices > 1 and rule.get(axis) == mesh_axis and chosen[dim] is None and size % devices == 0
        ]
        if allowed:
            chosen[max(allowed, key=lambda dim: (shape[dim], -dim))] = mesh_axis
    return tuple(chosen)


def parameter_mesh_axes(name: str, shape: tuple[int, ...], layout: str, mesh: dict[str, int]) -> tuple[str | None, ...]:
    """``mesh_axes`` of the parameter ``name`` (or an optimizer moment of it, same shape)."""
    return mesh_axes(axes_of(name), shape, layout, mesh)


def is_split(name: str, shape: tuple[int, ...], layout: str, mesh: dict[str, int]) -> bool:
    return any(axis is not None for axis in parameter_mesh_axes(name, shape, layout, mesh))
