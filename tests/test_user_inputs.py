"""What users bring, taken exactly and refused early (issue 30 items C-F).

C: a plan says the sequence length it was made at and where it came from (a Hugging Face config's
   `max_position_embeddings` is chosen silently otherwise), in its first line and its JSON.
D: everything that needs no graph (spec grammar and ranges, degrees against the cluster, what the
   model's config states) is refused before the capture: the capture is patched to fail here.
E: expert parallelism on a dense model says so; a factory module takes --seq-len and --vocab.
F: a model built from a Hugging Face config captures SDPA whatever transformers' default.
"""
from __future__ import annotations

import json
import time

import pytest
import torch

import mplan
from mplan.cli import main
from mplan.planner.parallel_config import PlanSpecError

H100 = mplan.ClusterSpec.preset("dgx-h100", nodes=1)


def _hf_config(path, **extra):  # noqa: ANN001, ANN202
    transformers = pytest.importorskip("transformers")
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    transformers.Qwen2Config(**{**fields, **extra}).save_pretrained(path)
    return str(path)


def _no_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every capture path fails the test: a refusal must come before it."""
    import mplan.api
    import mplan.bench
    import mplan.planner.planning as planning

    def captured(*_: object, **__: object) -> None:
        pytest.fail("captured before refusing")

    monkeypatch.setattr(planning, "capture_for_planning", captured)
    monkeypatch.setattr(mplan.bench, "capture_for_planning", captured)
    monkeypatch.setattr(mplan.api, "capture_for_training", captured)


# --- C: the sequence length and its source --------------------------------------------------------
def test_a_hugging_face_config_plan_says_its_sequence_length_came_from_the_config(tmp_path, capsys) -> None:  # noqa: ANN001
    config = _hf_config(tmp_path / "qwen")
    written = tmp_path / "plan.json"
    assert main(["plan", config, "--cluster", "dgx-h100", "--global-batch", "8", "-o", str(written)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "at sequence length 64 (the config's max_position_embeddings; --seq-len plans another)" in first, first
    doc = json.loads(written.read_text())
    assert doc["model"]["seq_len"] == 64 and doc["model"]["seq_len_source"] == "config max_position_embeddings"

    made = mplan.plan(config, cluster=H100, global_batch=8, seq_len=32)
    assert (made.model.seq_len, made.model.seq_len_source) == (32, "--seq-len")
    assert mplan.plan("tiny-llama", cluster=H100, global_batch=8).model.seq_len_source == "model preset"
    assert mplan.Plan.from_dict(made.to_dict()).model.seq_len_source == "--seq-len"


def test_a_plan_file_written_before_the_source_was_recorded_still_loads(tmp_path, capsys) -> None:  # noqa: ANN001
    from mplan.planner.plan import PlanError

    doc = mplan.plan("tiny-llama", cluster=H100, global_batch=8).to_dict()
    del doc["model"]["seq_len_source"]
    old = mplan.Plan.from_dict(doc)
    assert old.model.seq_len_source is None
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    assert main(["explain", str(path)]) == 0
    assert "at sequence length 16 (source not recorded" in capsys.readouterr().out.splitlines()[0]
    with pytest.raises(PlanError, match="model.seq_len_source must be one of"):
        mplan.Plan.from_dict({**doc, "model": {**doc["model"], "seq_len_source": "guessed"}})


def test_autoparallel_records_the_example_inputs_as_the_source() -> None:
    from mplan.models import build_model

    model = build_model("tiny-llama", device="cpu", dtype=torch.float64, seed=0)
    ids = torch.zeros(2, 8, dtype=torch.long)
    pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=2, plan="dp=1")
    assert (pm.plan.model.seq_len, pm.plan.model.seq_len_source) == (8, "example inputs")


# --- D: refusals before the capture ---------------------------------------------------------------
@pytest.mark.parametrize("spec,match", [
    ("tp=16", r"plan spec 'tp=16': tp = 16 > 8 GPUs, the whole cluster"),
    ("zero=5", r"zero must be 0, 1, 2 or 3 .*, got '5'"),
    ("tp=3", r"tp=3 does not divide the model's 32 attention heads"),
    ("pp=4,dp=2,tp=2", r"pp=4 exceeds the model's 2 layers|dp x tp x pp = 2 x 2 x 4 = 16 > 8 GPUs"),
    ("dp=8", r"global batch 12 is not divisible by dp=8"),
])
def test_plan_refuses_what_needs_no_graph_before_capturing(spec: str, match: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _no_capture(monkeypatch)
    start = time.perf_counter()
    with pytest.raises(PlanSpecError, match=match):
        mplan.plan("llama3-8b", cluster=H100, global_batch=12, spec=spec)
    assert time.perf_counter() - start < 1.0


def test_the_cli_refuses_before_capturing_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    _no_capture(monkeypatch)
    start = time.perf_counter()
    assert main(["plan", "llama3-8b", "--global-batch", "8", "--spec", "tp=16"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("mplan plan: error: plan spec 'tp=16': tp = 16 > 8 GPUs"), line
    assert time.perf_counter() - start < 1.0


def test_bench_refuses_each_row_before_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    from mplan.bench import bench_plans

    _no_capture(monkeypatch)
    start = time.perf_counter()
    rows = bench_plans("llama3-8b", H100, 8, ["tp=16", "zero=5", "ep=2"])
    assert time.perf_counter() - start < 2.0
    assert [r["spec"] for r in rows] == ["tp=16", "zero=5", "ep=2"]
    assert "tp = 16 > 8 GPUs" in rows[0]["error"] and "zero must be 0, 1, 2 or 3" in rows[1]["error"]
    assert "llama3-8b has no MoE layer" in rows[2]["error"]


def test_bench_keeps_the_good_rows_beside_a_refused_one() -> None:
    from mplan.bench import bench_plans

    bad, good = bench_plans("tiny-llama", H100, 8, ["tp=16", "tp=2"])
    assert "tp = 16 > 8 GPUs" in bad["error"] and good["error"] is None and good["mesh"]["tp"] == 2


@pytest.mark.parametrize("plan,match", [
    ("tp=3", r"tp\*pp = 3\*1 = 3 does not divide the world size 1"),
    ("dp=1,zero=5", r"zero must be 0, 1, 2 or 3"),
    ("dp=1,mbs=3", r"not a multiple of the micro-batch size 3"),
])
def test_autoparallel_refuses_a_spec_string_before_capturing(plan: str, match: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from mplan.models import build_model

    _no_capture(monkeypatch)
    model = build_model("tiny-llama", device="cpu", dtype=torch.float64, seed=0)
    start = time.perf_counter()
    with pytest.raises(PlanSpecError, match=match):
        mplan.autoparallel(model, example_inputs=(torch.zeros(2, 8, dtype=torch.long),), global_batch=4, plan=plan)
    assert time.perf_counter() - start < 1.0


def test_autoparallel_refuses_what_a_users_module_config_states_before_capturing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A module with a config (mplan's families, transformers' models) states its heads and
    experts: a spec string against them is refused before the capture, naming the model."""
    from mplan.models import build_model
    from mplan.planner.resolve import check_before_capture

    _no_capture(monkeypatch)
    model = build_model("tiny-llama", device="cpu", dtype=torch.float64, seed=0)
    with pytest.raises(PlanSpecError, match="has no MoE layer"):
        mplan.autoparallel(model, example_inputs=(torch.zeros(2, 8, dtype=torch.long),), global_batch=4,
                           plan="dp=1,capacity=1.25")
    heads, layers = model.config.num_heads, model.config.num_layers
    with pytest.raises(PlanSpecError, match=f"plan 'tp=3': tp=3 does not divide the model's {heads} attention heads"):
        check_before_capture("tp=3", world_size=3, global_batch=3, model=model)
    # stages are cut over units, the prologue and the epilogue too: more stages than layers can run
    assert check_before_capture(f"pp={layers + 2}", world_size=layers + 2, global_batch=layers + 2,
                                model=model) == f"pp={layers + 2}"
    assert check_before_capture("tp=2", world_size=2, global_batch=2, model=model) == "tp=2"
    assert check_before_capture("tp=3", world_size=3, global_batch=3, model=torch.nn.Linear(2, 2)) == "tp=3"


def test_verify_refuses_before_starting_its_ranks(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    import mplan.verify

    monkeypatch.setattr(mplan.verify, "verify_plan", lambda *a, **k: pytest.fail("ranks started before refusing"))
    assert main(["verify", "tiny-llama", "--plan", "ep=2"]) == 2
    assert "tiny-llama has no MoE layer" in capsys.readouterr().err
    assert main(["verify", "tiny-llama", "--plan", "tp=two"]) == 2
    assert "tp must be a positive integer" in capsys.readouterr().err


# --- E: the refusal says the cause; a factory takes --seq-len and --vocab ---------------------------
def test_expert_parallelism_on_a_dense_model_says_it_has_no_moe_layer(capsys) -> None:  # noqa: ANN001
    assert main(["plan", "llama3-8b", "--global-batch", "8", "--spec", "ep=2"]) == 2
    err = capsys.readouterr().err
    assert "llama3-8b has no MoE layer" in err and "no split of" not in err


def test_the_search_says_so_too_when_only_the_graph_knows() -> None:
    """A module whose config says nothing of experts reaches the search: its refusal names the cause."""
    from mplan.planner.parallel_config import parse_plan_spec
    from mplan.planner.planning import capture_for_planning
    from mplan.planner.search import Planner, PlanningError

    planner = Planner(capture_for_planning("tiny-llama"), H100)
    with pytest.raises(PlanningError, match="has no MoE layer"):
        planner.search(8, parse_plan_spec("ep=2"))


FACTORY = """
import torch
from mplan.models import PRESETS
from mplan.models.llama import LlamaModel


class Bare(torch.nn.Module):
    '''A module that states neither its sequence length nor its vocabulary (no `config`).'''

    def __init__(self):
        super().__init__()
        self.inner = LlamaModel(PRESETS["tiny-llama"])

    def forward(self, ids, labels=None):
        return self.inner(ids, labels=labels)


def bare():
    return Bare()
"""


def test_a_factory_module_plans_at_the_given_seq_len_and_takes_a_vocab(tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    from mplan.models.spec import resolve_model

    (tmp_path / "user_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "user_models:bare", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "states no sequence length" in err and "--seq-len" in err, err
    written = tmp_path / "plan.json"
    assert main(["plan", "user_models:bare", "--global-batch", "8", "--seq-len", "16", "--vocab", "64",
                 "-o", str(written)]) == 0
    assert json.loads(written.read_text())["model"]["seq_len"] == 16
    assert resolve_model("user_models:bare", vocab=64).vocab == 64
    assert main(["plan", "tiny-llama", "--global-batch", "8", "--vocab", "100"]) == 2
    assert "states its vocabulary, 64 tokens; --vocab 100" in capsys.readouterr().err


def test_vocab_is_in_the_help(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--vocab" in capsys.readouterr().out


# --- F: the attention implementation is pinned ----------------------------------------------------
def test_a_config_captures_sdpa_whatever_transformers_defaults_to(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A transformers release whose default is eager (simulated: no implementation asked -> eager)
    must not change what mplan captures from a config."""
    from transformers import PreTrainedModel

    from mplan.planner.planning import capture_spec

    config = _hf_config(tmp_path / "qwen")
    chosen = PreTrainedModel.get_correct_attn_implementation

    def eager_by_default(self, requested, is_init_check=False):  # noqa: ANN001, ANN202
        return chosen(self, "eager" if requested is None else requested, is_init_check)

    monkeypatch.setattr(PreTrainedModel, "get_correct_attn_implementation", eager_by_default)
    graph = capture_spec(config, batch=2, seq_len=16)
    ops = {node.op for node in graph.nodes}
    assert any("scaled_dot_product" in op for op in ops), sorted(ops)
