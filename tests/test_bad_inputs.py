"""No silent wrong answers (issue 24, items 8-13): each bad input is refused by name with its
fix, or gives the documented behaviour; never NaN counted as a match, never a traceback for a
user error."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import bitmatch
from bitmatch.diagnostics.verify import compare
from bitmatch.engine import Engine, SamplingParams
from bitmatch.testing.models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=3, num_hidden_layers=1)


# -- item 8: temperatures that underflow float32; NaN is never a match ---------------------------

@pytest.mark.parametrize("t", [1e-46, 1e-45, 1e-39, 1.1754942e-38])
def test_temperature_below_the_smallest_normal_float32_is_refused(model, t):
    rng = r"\[1.1754944e-38, 3.4028235e\+38\]"
    with pytest.raises(ValueError, match=rf"SamplingParams: temperature must be 0 \(greedy\) or a float in {rng}, "
                                         rf"got {t!r}: below the smallest normal float32 its reciprocal overflows"):
        SamplingParams(temperature=t)
    ids = torch.tensor([[1, 5, 6, 7]])
    with pytest.raises(ValueError, match=rf"token_logprobs: temperature must be a float in {rng}, got {t!r}"):
        bitmatch.token_logprobs(model, ids, temperature=t)


@pytest.mark.parametrize("t", [float("inf"), 1e39, float("nan"), -1.0, -0.0 - 1e-300])
def test_temperature_not_finite_in_float32_is_refused(t):
    with pytest.raises(ValueError, match=r"SamplingParams: temperature must be (>= 0, got \S+ \(valid: )?0 "
                                         r"\(greedy\) or a float in \[1.1754944e-38, 3.4028235e\+38\]"):
        SamplingParams(temperature=t)


def test_smallest_normal_temperature_is_accepted():
    assert SamplingParams(temperature=2.0 ** -126).temperature == 2.0 ** -126
    assert SamplingParams(temperature=0).greedy


def test_scaled_logits_overflowing_float32_are_refused_not_nan(model):
    """T = 2**-126 is valid, but logits above 4 divided by it overflow float32: both sides refuse
    the NaN logprobs (the engine drops the step's requests) instead of reporting them."""
    big = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=3, num_hidden_layers=1)
    with torch.no_grad():
        big.lm_head.weight.mul_(1e3)
    t = 2.0 ** -126
    with pytest.raises(ValueError, match=r"token_logprobs: \d+ of 3 logprobs are NaN: the logits divided by "
                                         r"temperature=1.1754943508222875e-38 are not finite in float32; raise"):
        bitmatch.token_logprobs(big, torch.tensor([[1, 5, 6, 7]]), temperature=t)
    eng = Engine(big)
    with pytest.raises(ValueError, match=r"Engine: request \S+ \(and 0 more in this step\) sampled a token with a "
                                         r"NaN logprob: its logits divided by temperature=1.17\S+ are not finite"):
        eng.generate([[1, 5, 6]], SamplingParams(temperature=t, max_tokens=2, seed=1))
    assert not eng.has_unfinished_requests()
    out = eng.generate([[1, 5, 6]], SamplingParams(temperature=1.0, max_tokens=2, seed=1))  # the engine still works
    assert len(out[0].outputs[0].token_ids) == 2


def test_compare_counts_nan_as_a_mismatch():
    nan = float("nan")
    r = compare([[-1.0, nan]], [[-1.0, nan]])  # the same NaN bits on both sides
    assert not r.bitmatched and r.mismatches == 1 and r.first_divergence == (0, 1)
    assert r.max_abs_diff == float("inf")
    r = compare([[-1.0, -2.0]], [[-1.0, nan]])
    assert r.mismatches == 1 and r.first_trainer_hex == "0x7fc00000"
    r = compare(torch.tensor([[nan, -0.5]]), torch.tensor([[-0.25, -0.5]]))
    assert r.mismatches == 1 and r.first_divergence == (0, 0)
    ninf = float("-inf")  # masked tokens on both sides are still a match
    assert compare([[ninf, -1.0]], [[ninf, -1.0]]).bitmatched


# -- item 11: the CLI: exit 2 with one line for a user error; messages name the argument given ------

def _one_line_err(capsys) -> str:
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert "Traceback" not in cap.err and "\n" not in err, cap.err
    return err


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Broken checkpoint folders beside a good one: the cases users hit."""
    import json
    import shutil

    root = tmp_path_factory.mktemp("ckpt")
    good = root / "good"
    tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0, num_hidden_layers=1).save_pretrained(good)
    (root / "badcfg").mkdir()
    (root / "badcfg" / "config.json").write_text("{not json")
    shutil.copytree(good, root / "noweights")
    (root / "noweights" / "model.safetensors").unlink()
    shutil.copytree(good, root / "trunc")
    data = (good / "model.safetensors").read_bytes()
    (root / "trunc" / "model.safetensors").write_bytes(data[:len(data) // 2])
    shutil.copytree(good, root / "unknown_type")
    cfg = json.loads((good / "config.json").read_text())
    cfg["model_type"] = "no_such_model_bm"
    (root / "unknown_type" / "config.json").write_text(json.dumps(cfg))
    return root


@pytest.mark.parametrize("case, text", [
    ("missing", "load_model: no checkpoint folder at '{root}/missing'"),
    ("badcfg", "load_model: '{root}/badcfg/config.json' is not valid JSON (Expecting property name"),
    ("noweights", "load_model: '{root}/noweights' has a config.json but no weights (no *.safetensors or "
                  "pytorch_model*.bin); re-download or re-save the checkpoint"),
    ("trunc", "load_model: weights file '{root}/trunc/model.safetensors' is truncated or corrupt: it holds"),
    ("unknown_type", "could not load '{root}/unknown_type' (ValueError: The checkpoint you are trying to load has "
                     "model type `no_such_model_bm`"),
])
def test_locate_load_errors_exit_2_with_one_line(checkpoints, capsys, case, text):
    from bitmatch.cli import main
    assert main(["locate", str(checkpoints / case), "--pair", "engine"]) == 2
    err = _one_line_err(capsys)
    assert err.startswith("bitmatch locate: ") and text.format(root=checkpoints) in err, err


def test_locate_uncached_hub_name_offline_exits_2(monkeypatch, capsys):
    from huggingface_hub import constants

    from bitmatch.cli import main
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["locate", "no-org-bm/no-model-bm", "--pair", "engine"]) == 2
    assert "is not a local folder and not in the hub cache, and hub access is off" in _one_line_err(capsys)


@pytest.mark.parametrize("args, text", [
    (["--prompts", "0"], "bitmatch locate: --prompts must be >= 1, got 0"),
    (["--min-len", "10", "--max-len", "5"], "bitmatch locate: --min-len 10 is more than --max-len 5: give "
                                            "--min-len <= --max-len"),
    (["--temperature", "1e-46"], "bitmatch locate: --temperature must be a float in [1.1754944e-38, "),
    (["--json", "/no/such/folder/r.json"], "bitmatch locate: --json: the folder '/no/such/folder' does not exist"),
    (["--inject", "bogus"], "bitmatch locate: --inject must be weight:LAYER.PARAM"),
])
def test_locate_bad_options_name_the_flag(capsys, args, text):
    from bitmatch.cli import main
    assert main(["locate", "--family", "qwen3", "--pair", "engine", *args]) == 2
    assert _one_line_err(capsys).startswith(text)


def test_check_json_to_a_missing_folder_fails_before_the_run(monkeypatch, capsys):
    from bitmatch import cli
    from bitmatch.cli import check

    monkeypatch.setattr(check, "_cases", lambda device: pytest.fail("the check ran before --json was checked"))
    assert cli.main(["check", "--device", "cpu", "--json", "/no/such/folder/check.json"]) == 2
    assert _one_line_err(capsys) == ("bitmatch check: --json: the folder '/no/such/folder' does not exist; create it "
                                     "first (mkdir -p) or give another path")


@pytest.mark.parametrize("args, text", [
    (["--model", "{root}/badcfg"], "bitmatch demo: --model: load_model: '{root}/badcfg/config.json' is not valid JSON"),
    (["--model", "{root}/noweights"], "bitmatch demo: --model: load_model: '{root}/noweights' has a config.json but "
                                      "no weights"),
    (["--out", "{root}/good/config.json"], "bitmatch demo: --out '{root}/good/config.json' is a file, not a folder"),
    (["--out", "/proc/bitmatch-demo"], "bitmatch demo: --out: '/proc' is not writable, so nothing can be written"),
    (["--num-prompts", "0"], "bitmatch demo: --num-prompts must be >= 1, got 0"),
])
def test_demo_user_errors_exit_2_with_one_line(checkpoints, capsys, args, text):
    from bitmatch.cli import main
    with pytest.raises(SystemExit) as e:
        main(["demo", *[a.format(root=checkpoints) for a in args]])
    assert e.value.code == 2
    assert _one_line_err(capsys).startswith(text.format(root=checkpoints))


def test_internal_error_is_not_the_divergence_code(monkeypatch, capsys):
    from bitmatch import cli
    from bitmatch.cli import check

    def boom(device):
        raise KeyError("a bug")
    monkeypatch.setattr(check, "_cases", boom)
    assert cli.main(["check", "--device", "cpu"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "bitmatch check: internal error (exit 3); please report it" in err


@pytest.mark.parametrize("prompts, sp, text", [
    ([[1.0, 2.0]], None, "Engine.generate: prompts[0][0] must be an int token id, got float 1.0"),
    ([[5, True]], None, "Engine.generate: prompts[0][1] must be an int token id, got bool True"),
    ([np.array([1.5, 2.0])], None, "Engine.generate: prompts[0] must hold integer token ids, got ndarray of shape "
                                   "(2,), dtype float64"),
    (torch.tensor([[1, 2], [3, 4]]), None, "Engine.generate: prompts must be a list of prompts (token-id lists or "
                                           "strings) or one prompt, got Tensor of shape (2, 2), dtype torch.int64; "
                                           "pass a list of token-id lists"),
    ([[1, 2]], {"temperature": 0.5}, "Engine.generate: sampling_params (one, or a list of one per prompt) must be a "
                                     "bitmatch.SamplingParams, got dict (pass SamplingParams(**{'temperature': 0.5}))"),
    ([[1, 2]], ["greedy"], "Engine.generate: sampling_params[0] must be a bitmatch.SamplingParams, got str 'greedy'"),
])
def test_engine_input_errors_name_the_argument_given(model, prompts, sp, text):
    eng = Engine(model, num_gpu_blocks=8)
    with pytest.raises(ValueError) as e:
        eng.generate(prompts, sp, use_tqdm=False)
    assert str(e.value).startswith(text), str(e.value)
    assert not eng.has_unfinished_requests()


def test_engine_takes_numpy_ids_and_one_dimensional_tensors(model):
    eng = Engine(model, num_gpu_blocks=8)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = eng.generate([np.array([1, 5, 9]), torch.tensor([1, 5, 9]), [np.int64(1), np.int32(5), 9]], sp,
                        use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1 and outs[0].prompt_token_ids == [1, 5, 9]


# -- item 10: top_k beyond int64, seeds beyond 64 bits, bool temperature, fp16 at construction ---------

@pytest.mark.parametrize("k", [2 ** 63, 10 ** 30, 128])
def test_top_k_at_or_above_the_vocabulary_is_no_top_k(model, k):
    """Documented (SamplingParams, README): k >= vocabulary size keeps every token, for any int k;
    2**63 once overflowed int64 in both the engine and token_logprobs."""
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    base = bitmatch.token_logprobs(model, ids, temperature=0.8)
    assert torch.equal(bitmatch.token_logprobs(model, ids, temperature=0.8, top_k=k), base)
    eng = Engine(model, num_gpu_blocks=8)
    got, want = (eng.generate([[1, 5, 6]], SamplingParams(temperature=0.8, top_k=kk, max_tokens=3, seed=4),
                              use_tqdm=False)[0].outputs[0] for kk in (k, -1))
    assert got.token_ids == want.token_ids and got.sampled_logprobs == want.sampled_logprobs == got.logprobs


@pytest.mark.parametrize("seed", [2 ** 64, -1, 2 ** 70])
def test_seed_outside_64_bits_is_refused(model, seed):
    with pytest.raises(ValueError, match=r"SamplingParams: seed must be None or an int in \[0, 2\*\*64\) \(the noise "
                                         rf"is keyed by 64 bits: a larger or negative seed would alias another\), "
                                         rf"got {seed}"):
        SamplingParams(seed=seed)
    with pytest.raises(ValueError, match=rf"Engine: seed must be an int in \[0, 2\*\*64\), got {seed}"):
        Engine(model, seed=seed, num_gpu_blocks=8)
    assert SamplingParams(seed=2 ** 64 - 1).seed == 2 ** 64 - 1


@pytest.mark.parametrize("t", [True, False, np.bool_(True)])
def test_bool_temperature_is_refused_on_both_sides(model, t):
    with pytest.raises(ValueError, match=r"SamplingParams: temperature must be 0 \(greedy\) or a float in \[1.17"
                                         rf"\S+, \S+\], got {t!r} \(bool_?\)"):
        SamplingParams(temperature=t)
    with pytest.raises(ValueError, match=r"token_logprobs: temperature must be a float in \[1.17\S+, \S+\], got "
                                         rf"{t!r} \(bool_?\)"):
        bitmatch.token_logprobs(model, torch.tensor([[1, 5, 6]]), temperature=t)


def test_fp16_model_is_refused_at_engine_construction():
    m16 = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float16, seed=0, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"^Engine: the model's parameters are torch.float16, but bitmatch computes "
                                         r"in bf16 or fp32: load it with dtype=torch.bfloat16 .*bitmatch.patch\(model, "
                                         r"compute_dtype=torch.bfloat16\) before Engine\(model\)$"):
        Engine(m16, num_gpu_blocks=8)
    bitmatch.patch(m16, compute_dtype=torch.bfloat16)  # the fix the message names works
    out = Engine(m16, num_gpu_blocks=8).generate([[1, 5]], SamplingParams(max_tokens=2, ignore_eos=True),
                                                 use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# -- item 9: an attention mask with a hole is refused, padding on either side (or both) is not -----

def test_attention_mask_with_a_hole_is_refused(model):
    ids = torch.tensor([[0, 1, 5, 6, 7, 8], [1, 5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"^token_logprobs: attention_mask row 1 has a 0 at column 2 between 1s; only "
                                         r"left or right padding is supported \(a hole would be scored as if the token "
                                         r"were deleted, positions renumbered, not as HF scores that mask\): drop the "
                                         r"token from input_ids"):
        bitmatch.token_logprobs(model, ids, mask)
    # left + right padding and an all-zero row are accepted, and equal the unpadded rows' values
    ok = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    lp = bitmatch.token_logprobs(model, ids, ok)
    alone = bitmatch.token_logprobs(model, ids[:1, 1:5])
    assert torch.equal(lp[0, 1:4], alone[0]) and not lp[1].any()


# -- item 13: the demo without matplotlib says what it wrote ---------------------------------------

def test_demo_without_matplotlib_does_not_claim_a_plot(monkeypatch, tmp_path, capsys):
    from bitmatch import demo

    def no_matplotlib(*a, **k):
        raise ImportError("No module named 'matplotlib'")
    monkeypatch.setattr(demo, "_plot", no_matplotlib)
    demo.run(out_dir=str(tmp_path), num_prompts=3, max_tokens=2)
    out = capsys.readouterr().out
    assert "(matplotlib not installed: no diff.png; pip install bitmatch[plot], or pass --no-plot)" in out
    assert f"wrote {tmp_path / 'report.json'}\n" in out and "diff.png\n" not in out
    assert not (tmp_path / "diff.png").exists()


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_device_range_check_passes_in_range_and_fails_outside(backend):
    """check_in_range (the device-side check of ids and positions: one Triton reduction then the
    assert) over more than one 1024-wide block: in range passes, one element out at either end fails."""
    import bitmatch.kernels as K
    from bitmatch.kernels._backend import check_in_range
    t = torch.arange(-1, 2000)
    with K.use_backend(backend):
        check_in_range(t, -1, 2000, "ok")
        for lo, hi in ((0, 2000), (-1, 1999)):
            with pytest.raises(RuntimeError, match="out of range"):
                check_in_range(t, lo, hi, "out of range")
