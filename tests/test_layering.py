"""The architecture as a test: dependencies point down ir -> cost_models -> planner -> (Plan) ->
passes -> runtime, with kernels, models and collectives as leaves; and the runtime, given a saved
Plan, never solves, searches or consults the op registry.

Every module's imports are read from its source (module level and inside functions alike), so an
arrow against the order fails here naming the module, the line and the import, whether or not
the code path runs in any other test.
"""
from __future__ import annotations

import ast
import functools
import pathlib

import pytest
import torch

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mplan"

# What each layer may import, besides itself. `mplan.planner.plan` is the bridge: the Plan record
# (and what it needs to be read back) is all the passes and the runtime may know of planning.
BRIDGE = {"mplan.planner.plan", "mplan.planner.parallel_config"}
ALLOWED: dict[str, set[str]] = {
    "refusal": set(),  # how a refused run ends (one line on rank 0): the runtime's torchrun hook uses it
    "progress": set(),  # a word while it works (phases and their times on stderr): planner, API and runtime report
    "json_fields": set(),  # reading a JSON file field by field, each error naming its field: every reader's
    "kernels": set(),
    "data": {"json_fields", "progress"},  # text to token shards and packed batches: no layer imports it, it
    # imports none (the index is read field by field; `mplan data prepare` reports phases)
    "models": {"kernels", "json_fields"},  # the MoE family's experts are the `moe_experts` op; config.json
    # capture turns experts modules into the `moe_experts` op of `mplan.kernels.moe`
    "ir": {"kernels"},
    # the fusion registry: each fused kernel's pattern (on the captured graph), what it keeps, its
    # price and launches, and its emitter (which imports its kernel when it runs)
    "fusion": {"ir", "kernels"},
    "collectives": {"ir"},
    "cost_models": {"ir", "json_fields"},
    "planner": {"ir", "fusion", "cost_models", "kernels", "json_fields", "progress", "models"},  # kernels: the
    # head + loss's chunk sizes; models: capturing a model spec, and refusing an impossible plan spec before capture
    "passes": {"ir", "fusion", "cost_models", "collectives", "kernels", "models"} | BRIDGE,
    "runtime": {"ir", "fusion", "cost_models", "collectives", "kernels", "models", "passes", "refusal", "json_fields",
                "progress"} | BRIDGE,
}
TOP_LEVEL = {"__init__", "__main__", "api", "cli", "bench", "measure", "verify", "train", "summary", "host_calibration"}
"""The application layer: the public API and the commands (`train`: the `mplan train` run;
`summary`: the `mplan inspect` report; `host_calibration`: `mplan profile`'s run of the runtime),
which may use every layer."""


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@functools.lru_cache(maxsize=None)
def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(relative.parts).removesuffix(".__init__")
        found[name] = path
    return found


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name == "mplan" or name.startswith("mplan.")]


def _target(imported: str, modules: dict[str, pathlib.Path]) -> str:
    """The module an import names (`from mplan.ir.graph import Graph` -> mplan.ir.graph)."""
    while imported not in modules and "." in imported:
        imported = imported.rsplit(".", 1)[0]
    return imported


def _violations(modules: dict[str, pathlib.Path]) -> list[str]:
    found = []
    for module, path in sorted(modules.items()):
        layer = _layer(module)
        if layer in TOP_LEVEL:
            continue
        assert layer in ALLOWED, f"{module}: layer {layer!r} is not in the architecture"
        for line, imported in _imports(path):
            target = _target(imported, modules)
            other = _layer(target)
            if other == layer or target in ALLOWED[layer] or other in ALLOWED[layer]:
                continue
            found.append(f"{module}:{line} ({layer}) imports {imported}")
    return found


def test_dependencies_point_down_the_pipeline() -> None:
    assert _violations(_modules()) == []


def test_the_check_sees_an_upward_arrow(tmp_path: pathlib.Path) -> None:
    """The rule can fail: a planner module importing the runtime inside a function is reported."""
    rogue = tmp_path / "rogue.py"
    rogue.write_text("def f():\n    from mplan.runtime.parallel_module import parallelize\n", encoding="utf-8")
    found = _violations({**_modules(), "mplan.planner.rogue": rogue})
    assert found == ["mplan.planner.rogue:2 (planner) imports mplan.runtime.parallel_module.parallelize"]


class _Refusing(dict):
    def get(self, *_: object) -> None:
        raise AssertionError("the runtime read the op registry")

    __getitem__ = get


def test_running_a_saved_plan_calls_no_solver_search_or_registry(tmp_path: pathlib.Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A Plan saved by the planner trains and infers with the ILP, the search and the op registry
    patched to raise: the runtime only reads the Plan."""
    import mplan
    from mplan.models import build_model
    from mplan.planner import op_registry, search, sharding_ilp

    model = build_model("tiny-llama", device="cpu", dtype=torch.float64, seed=0)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    made = mplan.plan(model, (ids,), cluster=mplan.ClusterSpec.preset("cpu", gpus_per_node=1), global_batch=4,
                      runtime="mplan")
    path = str(tmp_path / "plan.json")
    made.save(path)

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the runtime called the planner")

    monkeypatch.setattr(sharding_ilp, "solve_segment_sharding", refuse)
    monkeypatch.setattr(search.Planner, "__init__", refuse)
    monkeypatch.setattr(op_registry, "strategies_for", refuse)
    monkeypatch.setattr(op_registry, "REGISTRY", _Refusing())
    pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=4, plan=path)
    assert pm.train_step(ids, ids) > 0
    assert pm(ids).shape == (4, 16, 64)
    assert pm.plan.planner["unbound_ops"] == 0  # every op bound by its key: nothing was filled in
