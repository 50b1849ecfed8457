"""`mplan plan MODEL --documents DIR`: the user's own data's mix of lengths priced for the plan's
cp (predicted), the layer's shapes read from the model given, and bad input refused in one line."""
from __future__ import annotations

import glob
import json
import os
import re
import time

import pytest

from mplan.cli import main
from mplan.models.spec import resolve_model
from mplan.planner.dynamic_context import LayerShape
from mplan.planner.model_shape import ShapeUnknown, layer_shape
from short_documents import short_documents

LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,seq=64,vocab=300,ffn=128"
GPT = "gpt:layers=2,hidden=64,heads=4,seq=64,vocab=300"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:  # noqa: ANN001
    """Shards of 400 short documents (1-14 words), so a share of 32 tokens holds whole ones."""
    return short_documents(tmp_path_factory.mktemp("plan_documents"), 400)


def _plan(capsys, *args: str) -> tuple[int, str, str]:  # noqa: ANN001
    status = main(["plan", *args, "--global-batch", "8", "-q"])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_a_cp_plan_prints_the_datas_mix_priced_and_the_advice(tokens: str, capsys) -> None:  # noqa: ANN001
    status, out, _ = _plan(capsys, LLAMA, "--spec", "cp=2,tp=1", "--documents", tokens)
    assert status == 0
    section = out[out.index(f"Documents in {tokens}: 400, median"):].splitlines()
    assert "at cp=2" in section[1] and "windows of 64 tokens" in section[1]
    shares = re.search(r"cp=1: (\d+)% of the loader's windows, (\d+)% of cp-aligned windows \(padding ([\d.]+)%\)",
                       section[2])
    assert shares and section[2].startswith("  predicted")
    assert int(shares[2]) > int(shares[1])  # the packing makes windows deal whole that the plain cuts do not
    times = re.search(r"predicted step time per real token .*: fixed CP on the loader's windows ([\d.]+) us, "
                      r"two-size rule on cp-aligned windows ([\d.]+) us \(([\d.]+)x\); dynamic CP's upper bound "
                      r"([\d.]+) us", section[3])
    assert times, section[3]
    fixed, aligned, ratio = float(times[1]), float(times[2]), float(times[3])
    assert ratio == pytest.approx(fixed / aligned, abs=0.01)
    expected = "set data.packing = \"cp_aligned\"" if ratio > 1.02 else "does not pay at cp=2"
    assert section[4].startswith("  advice: ") and expected in section[4]
    assert glob.glob(os.path.join(tokens, "cp_pack-v1-*.npz"))  # the pack `mplan train` reads back


def test_the_figures_come_from_the_model_given() -> None:
    shape = layer_shape(resolve_model(LLAMA))
    assert shape == LayerShape(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, num_layers=2)
    assert layer_shape(resolve_model("llama3-8b")) == LayerShape(hidden=4096, heads=32, kv_heads=8, head_dim=128,
                                                                 ffn=14336, num_layers=32)


def test_a_hugging_face_config_gives_its_own_head_dim(tmp_path) -> None:  # noqa: ANN001
    transformers = pytest.importorskip("transformers")
    transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=64).save_pretrained(tmp_path)
    assert layer_shape(resolve_model(str(tmp_path))) == LayerShape(hidden=32, heads=4, kv_heads=2, head_dim=16,
                                                                   ffn=48, num_layers=3)


def test_a_cp1_plan_says_in_one_line_that_the_mix_does_not_matter(tokens: str, capsys) -> None:  # noqa: ANN001
    status, out, _ = _plan(capsys, LLAMA, "--spec", "cp=1", "--documents", tokens)
    assert status == 0
    section = out[out.index(f"Documents in {tokens}"):].strip().splitlines()
    assert section[1:] == ["  this plan has cp = 1: the data's mix of lengths matters only under cp > 1"]


def test_a_directory_that_is_not_prepared_shards_is_refused_before_planning(tmp_path, capsys,  # noqa: ANN001
                                                                           monkeypatch) -> None:  # noqa: ANN001
    import mplan.planner.planning as planning

    monkeypatch.setattr(planning, "capture_for_planning", lambda *_, **__: pytest.fail("captured before refusing"))
    start = time.perf_counter()
    status, out, err = _plan(capsys, LLAMA, "--spec", "cp=2", "--documents", str(tmp_path))
    assert status == 2 and out == ""
    [line] = err.strip().splitlines()
    assert line.startswith(f"mplan plan: error: {tmp_path}") and "mplan data prepare" in line, line
    assert time.perf_counter() - start < 1.0


def test_a_model_without_a_gated_mlp_is_refused_in_one_line_and_the_plan_still_prints(tokens: str,  # noqa: ANN001
                                                                                       capsys) -> None:  # noqa: ANN001
    status, out, _ = _plan(capsys, GPT, "--spec", "cp=2,tp=1", "--documents", tokens)
    assert status == 0 and "dp=" in out
    section = out[out.index(f"Documents in {tokens}"):].strip().splitlines()
    assert section[1:] == [f"  not priced: {GPT}: a GPT layer's MLP is not gated (gate, up, down)"]
    with pytest.raises(ShapeUnknown, match="states no config"):
        layer_shape(resolve_model("torch.nn:Identity"))


def test_with_json_stdout_stays_the_plan_and_the_section_goes_to_stderr(tokens: str, capsys) -> None:  # noqa: ANN001
    status, out, err = _plan(capsys, LLAMA, "--spec", "cp=2,tp=1", "--documents", tokens, "--json")
    assert status == 0 and json.loads(out)["mesh"]["cp"] == 2
    assert f"Documents in {tokens}" in err and "advice:" in err
