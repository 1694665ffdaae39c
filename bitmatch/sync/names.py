"""HF parameter names -> engine layouts, from each model family's ``packed_modules`` (bitmatch.models).

vLLM stores a dense decoder layer's q/k/v projections as one ``qkv_proj`` and gate/up as one
``gate_up_proj``, concatenated along dim 0 in that order. Each HF tensor therefore lands in a
contiguous row block of one engine tensor; since a row block of a contiguous tensor is a
contiguous byte range, the HF tensor's fingerprint can be checked on the engine's bytes
directly. ``build_layout`` checks the mapping both ways: every HF parameter lands in exactly
one place, and every engine parameter's rows are covered exactly once, with no gap.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from bitmatch.models import family_for_architecture


def layout_rules(arch: str) -> tuple:
    """vLLM's merge/rename rules for ``arch``: the family's ``packed_modules`` (bitmatch.models)."""
    return family_for_architecture(arch).packed_modules


@dataclass(frozen=True)
class Slot:
    """Where one HF tensor lives in the engine: rows [row_start, row_start + rows) of engine_name."""
    engine_name: str
    row_start: int
    rows: int
    shard: int  # index in the merge order (0 for unmerged tensors)


@dataclass
class Layout:
    hf_to_engine: dict[str, Slot] = field(default_factory=dict)
    engine_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def engine_to_hf(self) -> dict[str, list[tuple[str, Slot]]]:
        out: dict[str, list[tuple[str, Slot]]] = {}
        for hf, slot in self.hf_to_engine.items():
            out.setdefault(slot.engine_name, []).append((hf, slot))
        for v in out.values():
            v.sort(key=lambda p: p[1].row_start)
        return out


def architecture_of(model) -> str:
    cfg = getattr(model, "config", None)
    archs = getattr(cfg, "architectures", None) or []
    return archs[0] if archs else type(model).__name__


def _engine_name(hf_name: str, rules) -> tuple[str, int]:
    # matched on whole dotted components: a module ("self_attn.q_proj" in "...q_proj.weight") or a
    # parameter itself ("mlp.experts.gate_up_proj", renamed to FusedMoE's "w13_weight")
    for merged, parts in rules:
        for i, part in enumerate(parts):
            key = f".{part}."
            if key in f".{hf_name}.":
                return f".{hf_name}.".replace(key, f".{merged}.", 1)[1:-1], i
    return hf_name, 0


def build_layout(arch: str, hf_shapes: dict[str, tuple[int, ...]],
                 engine_shapes: dict[str, tuple[int, ...]] | None = None) -> Layout:
    """Map HF names/shapes to vLLM's layout for ``arch``; optionally check against the engine's own
    parameter shapes. Raises ValueError naming every unmapped, doubly mapped or mis-shaped tensor."""
    rules = layout_rules(arch)  # ValueError naming the supported architectures for an unknown one
    n_parts = {merged: len(parts) for merged, parts in rules}
    groups: dict[str, dict[int, str]] = {}
    for hf in hf_shapes:
        eng, shard = _engine_name(hf, rules)
        g = groups.setdefault(eng, {})
        if shard in g:
            raise ValueError(f"HF tensors {g[shard]!r} and {hf!r} map to the same slot of {eng!r}")
        g[shard] = hf
    layout = Layout()
    for eng, shards in groups.items():
        merged = next((m for m in n_parts if f".{m}." in f".{eng}."), None)
        want = n_parts[merged] if merged else 1
        if sorted(shards) != list(range(want)):
            missing = [i for i in range(want) if i not in shards]
            raise ValueError(f"engine tensor {eng!r} needs {want} HF shards, missing shard(s) {missing} "
                             f"(have {sorted(shards.values())})")
        row = 0
        tail = None
        for i in range(want):
            hf = shards[i]
            shape = tuple(hf_shapes[hf])
            if len(shape) == 0:
                shape = (1,)
            if tail is None:
                tail = shape[1:]
            elif shape[1:] != tail:
                raise ValueError(f"HF tensor {hf!r} shape {shape} does not stack with the other shards of {eng!r}")
            layout.hf_to_engine[hf] = Slot(eng, row, shape[0], i)
            row += shape[0]
        layout.engine_shapes[eng] = (row, *tail) if len(hf_shapes[shards[0]]) else ()
    if engine_shapes is not None:
        check_engine_shapes(layout, engine_shapes)
    return layout


def check_engine_shapes(layout: Layout, engine_shapes: dict[str, tuple[int, ...]]) -> None:
    """The other direction: every engine parameter is produced by the mapping, with its shape."""
    missing = sorted(set(engine_shapes) - set(layout.engine_shapes))
    extra = sorted(set(layout.engine_shapes) - set(engine_shapes))
    if missing or extra:
        raise ValueError(f"HF -> engine name mapping does not cover the engine exactly: engine parameters "
                         f"with no HF source {missing}; mapped names the engine lacks {extra}")
    for name, shape in layout.engine_shapes.items():
        if tuple(engine_shapes[name]) != tuple(shape):
            raise ValueError(f"engine tensor {name!r}: mapped shape {tuple(shape)} but engine has "
                             f"{tuple(engine_shapes[name])}")
