"""`mplan train`: one config runs a whole job on real token data, and a job stopped midway resumes
as if it never stopped: bit-identical under the same plan, within 1e-9 under another plan or
another data-parallel size (float64, gloo ranks); the config is validated key by key."""
from __future__ import annotations

import json
import os
import sysconfig

import pytest

from distributed import run_ranks

TOML = """
[model]
spec = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,seq=16,vocab=512"
dtype = "float64"

[optimizer]
lr = 3e-3

[schedule]
warmup_steps = 2

[train]
steps = 6
global_batch = 4
seq_len = 16
seed = 3

[data]
path = "{data}"

[checkpoint]
dir = "{ckpt}"

[metrics]
jsonl = "{jsonl}"
"""
TOL = 1e-9


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> str:
    from mplan.data.shards import prepare

    out = str(tmp_path_factory.mktemp("data") / "tokens")
    prepare(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py"), out, vocab_size=512)
    return out


def _config(directory: str, tokens: str, name: str) -> str:
    """Every rank writes the same config; each writes its own file and renames it into place, so
    no rank ever reads another's half-written (truncated) copy."""
    path = os.path.join(directory, f"{name}.toml")
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w", encoding="utf-8") as handle:
        handle.write(TOML.format(data=tokens, ckpt=os.path.join(directory, f"{name}-ckpt"),
                                 jsonl=os.path.join(directory, f"{name}.jsonl")))
    os.replace(partial, path)
    return path


def _losses(path: str) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, open(path, encoding="utf-8"))}


def run(config: str, overrides: list[str]) -> dict:
    from mplan.train.config import load_config
    from mplan.train.run import train

    summary = train(load_config(config, overrides), progress="quiet")
    return {"plan": summary.plan, "first": summary.first_step, "last": summary.last_step}


def two_ranks(directory: str, tokens: str) -> list[dict]:
    """On 2 ranks: 6 straight steps; 3 steps then stop; resumed under the same plan; resumed
    under another plan (copied checkpoint, its own JSONL)."""
    import shutil

    import torch.distributed as dist

    out = [run(_config(directory, tokens, "straight"), ["plan.spec=dp=2"]),
           run(_config(directory, tokens, "stopped"), ["plan.spec=dp=2", "train.stop_at=3"])]
    if dist.get_rank() == 0:
        for name in ("other", "wider", "one"):
            shutil.copytree(os.path.join(directory, "stopped-ckpt"), os.path.join(directory, f"{name}-ckpt"))
            shutil.copy(os.path.join(directory, "stopped.jsonl"), os.path.join(directory, f"{name}.jsonl"))
    dist.barrier()
    out.append(run(_config(directory, tokens, "stopped"), ["plan.spec=dp=2"]))
    out.append(run(_config(directory, tokens, "other"), ["plan.spec=tp=2"]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tokens: str) -> dict:
    directory = str(tmp_path_factory.mktemp("runs"))
    out = {"dir": directory, "2": run_ranks(2, two_ranks, directory, tokens)[0]}
    out["4"] = run_ranks(4, run, _config(directory, tokens, "wider"), ["plan.spec=dp=4"])[0]
    out["1"] = run(_config(directory, tokens, "one"), ["plan.spec=dp=1"])
    return out


def test_a_job_runs_from_its_config(runs) -> None:
    straight = _losses(os.path.join(runs["dir"], "straight.jsonl"))
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    assert runs["2"][0] == {"plan": runs["2"][0]["plan"], "first": 0, "last": 6}
    assert sorted(os.listdir(os.path.join(runs["dir"], "straight-ckpt"))) == ["latest", "step-00000006"]


def test_a_stopped_job_resumes_bit_identical_under_the_same_plan(runs) -> None:
    stopped, resumed = runs["2"][1], runs["2"][2]
    assert (stopped["first"], stopped["last"], resumed["first"], resumed["last"]) == (0, 3, 3, 6)
    assert _losses(os.path.join(runs["dir"], "stopped.jsonl")) == _losses(os.path.join(runs["dir"], "straight.jsonl"))


@pytest.mark.parametrize("name, plan", [("other", "tp=2"), ("wider", "dp=4"), ("one", "dp=1")])
def test_a_stopped_job_resumes_under_another_plan_or_dp_size(runs, name, plan) -> None:
    straight = _losses(os.path.join(runs["dir"], "straight.jsonl"))
    resumed = _losses(os.path.join(runs["dir"], f"{name}.jsonl"))
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):  # the same samples in the same order: the loader's position is in samples
        assert abs(resumed[step] - straight[step]) <= TOL * abs(straight[step]), (name, step)


@pytest.mark.parametrize("overrides, says", [
    (["train.stpes=3"], r"train.stpes is not a known key"),
    (["train.steps=three"], r"train.steps must be an integer, got 'three'"),
    (["optimizer.lr=-1"], r"optimizer.lr must be positive"),
    (["schedule.decay=step"], r"schedule.decay must be cosine, linear or constant"),
    (["trian.steps=3"], r"\[trian\] is not a known section"),
    (["steps=3"], r"--set 'steps=3': must be section.key=value"),
    (["metrics.profile_steps=5:2"], r"metrics.profile_steps must be a:b with a < b"),
    (["plan.cuda_graphs=maybe"], r"plan.cuda_graphs must be true or false, got 'maybe'"),
])
def test_a_wrong_key_or_value_is_one_line(tmp_path, tokens, overrides, says) -> None:
    from mplan.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=says):
        load_config(_config(str(tmp_path), tokens, "bad"), overrides)


def test_the_schedule_warms_up_then_decays_to_its_floor() -> None:
    from mplan.train.lr_schedule import lr_factor

    factors = [lr_factor(s, warmup=2, total=6, decay="cosine", min_ratio=0.1) for s in range(7)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[3] > factors[4] > factors[5] and factors[5] == pytest.approx(0.1) and factors[6] == factors[5]
    assert lr_factor(3, warmup=0, total=5, decay="linear", min_ratio=0.0) == pytest.approx(0.25)


def test_one_process_writes_a_trace_a_plot_and_refuses_tensorboard_it_lacks(tmp_path, tokens) -> None:
    from mplan.train.config import ConfigError, load_config
    from mplan.train.run import train

    config = _config(str(tmp_path), tokens, "observed")
    plot = str(tmp_path / "loss.png")
    summary = train(load_config(config, ["train.steps=3", "metrics.profile_steps=1:2", f"metrics.plot={plot}",
                                         "checkpoint.dir="]), progress="quiet")
    assert summary.checkpoint is None and summary.plot == plot and os.path.getsize(plot) > 1000
    trace = json.load(open(tmp_path / "trace-rank0.json", encoding="utf-8"))
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="metrics.tensorboard: tensorboard is not installed"):
            train(load_config(config, [f"metrics.tensorboard={tmp_path / 'tb'}"]), progress="quiet")
