"""The op table and its override (kernels/table.py): every exported op declared once with its axes,
stock counterpart, backends and order version; ``kernels.override`` changes what every caller
reaches, is undone on every exit, nests, marks the stamp, and no module binds an op by name."""
import ast
import importlib.util
import threading
from pathlib import Path

import pytest
import torch

import bitmatch
import bitmatch.kernels as K
from bitmatch.diagnostics.faults import kernel_fault, parse_inject
from bitmatch.engine import Engine, SamplingParams
from bitmatch.kernels import order, table
from bitmatch.models.deepseek_v4_tiny import tiny_model as v4_tiny_model
from bitmatch.testing.models import random_prompts, tiny_model
from test_golden_bits import CASES, _tensors

ROOT = Path(__file__).resolve().parents[1]
# not ops: constants and the table itself
NOT_CALLABLE_EXPORTS = {"SUPPORTED_DTYPES", "SUPPORTED_ROPE_TYPES", "OPS"}


def test_every_exported_op_has_a_table_entry():
    """A new op exported from bitmatch.kernels fails here until kernels/table.py declares it."""
    exported = {n for n in K.__all__ if n not in NOT_CALLABLE_EXPORTS and n not in table.HELPERS}
    assert exported == set(table.OPS), (f"exported ops without a table entry: {sorted(exported - set(table.OPS))}; "
                                        f"entries of no exported op: {sorted(set(table.OPS) - exported)}")
    versions = dict(order.ORDER.op_versions)
    for name, s in table.OPS.items():
        assert s.name == name and s.axes and set(s.axes) <= set(table.AXES), name
        assert s.backends and set(s.backends) <= {"reference", "triton", "torch"}, name
        # defined in the stock package (one file per group of op families), never copied elsewhere
        assert callable(s.stock) and s.stock.__module__.rpartition(".")[0] == "bitmatch.kernels.stock", name
        assert s.canonical is getattr(K, name), f"{name}: the table's canonical function is not the exported one"
        assert s.family in versions and s.version == versions[s.family], name
        if "triton" in s.backends:
            assert (ROOT / "bitmatch" / "kernels" / "triton" / f"{s.family}.py").exists(), name


def test_row_axis_is_declared_not_read_from_docstrings():
    """top_k_top_p_mask's docstring says "prefix sums": the old regex called it a sequence op."""
    assert table.OPS["top_k_top_p_mask"].row_wise and table.OPS["linear"].row_wise
    assert not table.OPS["attention_prefill"].row_wise and not table.OPS["mamba_chunk_scan"].row_wise
    assert "state" in table.OPS["attention_paged"].axes and "schedule" in table.OPS["causal_conv1d"].axes


@pytest.mark.parametrize("op", sorted(CASES))
def test_every_stock_op_runs_in_place_of_its_op(op):
    """Each golden case (it calls ``K.op``) under ``override({op: stock})``: the stock op has the op's
    signature and output structure, and agrees with it to rounding (uniform_noise: another RNG)."""
    for shape, case in CASES[op].items():
        torch.manual_seed(0)
        with torch.no_grad(), K.use_backend("reference"):
            want = _tensors(case())
        torch.manual_seed(0)
        with torch.no_grad(), K.override({op: table.OPS[op].stock}):
            got = _tensors(case())
        assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want], f"{op} {shape}"
        for g, w in zip(got, want):
            if op == "uniform_noise":
                assert bool(((g >= 0) & (g < 1)).all())
            elif g.is_floating_point():
                fin = torch.isfinite(w)
                assert torch.equal(fin, torch.isfinite(g)), f"{op} {shape}"
                assert torch.allclose(g[fin].double(), w[fin].double(), rtol=2e-2, atol=2e-2), f"{op} {shape}"
            else:
                assert torch.equal(g, w), f"{op} {shape}"


def _caller():
    """A caller in another module's style: reaches the op through the package at call time."""
    return K.linear(torch.ones(2, 4), torch.ones(3, 4))


def test_override_reaches_every_caller_and_is_undone():
    canon = table.OPS["linear"].canonical
    seen = []

    def fake(x, w, b=None, **kw):
        seen.append(x.shape)
        return torch.zeros(*x.shape[:-1], w.shape[0], dtype=x.dtype)
    with K.override({"linear": fake}) as replaced:
        assert replaced == {"linear": canon}
        assert K.linear is fake and table.overridden() == {"linear": fake}
        assert float(_caller().sum()) == 0 and seen == [(2, 4)]
        # a model's forward reaches it too (bitmatch.models call K.linear)
        m = bitmatch.patch(tiny_model("qwen3", seed=0))
        with torch.no_grad():
            m(torch.tensor([[1, 2, 3]]))
        assert len(seen) > 1
    assert K.linear is canon and table.overridden() == {}
    assert float(_caller().sum()) == 2 * 3 * 4


def test_override_reaches_the_deepseek_v4_row_ops():
    """The V4 attention block calls its row ops through the package: a stock override reaches the
    engine's and the trainer's forward (a fault injected there is seen), and the stamp says so."""
    calls = {"sink_attention_rows": 0, "indexer_select": 0}

    def counting(name):
        stock_fn = table.OPS[name].stock

        def f(*a, **k):
            calls[name] += 1
            return stock_fn(*a, **k)
        return f
    m = bitmatch.patch(v4_tiny_model(seed=0))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        want = bitmatch.token_logprobs(m, ids, None)
        with K.override({n: counting(n) for n in calls}):
            assert set(order.current().overridden_ops) >= set(calls)
            got = bitmatch.token_logprobs(m, ids, None)
    assert calls["sink_attention_rows"] > 0 and calls["indexer_select"] > 0, calls
    assert not torch.equal(got, want)  # the stock softmax is not the exact reference's


def test_override_nests_and_restores_on_exception():
    lin, norm = table.OPS["linear"].canonical, table.OPS["rms_norm"].canonical
    f1, f2, f3 = (lambda *a, **k: None), (lambda *a, **k: None), (lambda *a, **k: None)
    with pytest.raises(ZeroDivisionError):
        with K.override({"linear": f1}):
            with K.override({"linear": f2, "rms_norm": f3}) as replaced:
                assert replaced == {"linear": f1, "rms_norm": norm}
                assert (K.linear, K.rms_norm) == (f2, f3)
                assert order.current().overridden_ops == ("linear", "rms_norm")
                1 / 0
    assert (K.linear, K.rms_norm) == (lin, norm) and order.current() is order.ORDER
    with K.override({"linear": f1}):
        with K.override({"rms_norm": f3}):
            pass
        assert (K.linear, K.rms_norm) == (f1, norm) and order.current().overridden_ops == ("linear",)
    assert K.linear is lin and order.current() is order.ORDER


def test_override_marks_the_stamp():
    ref, tri = order.stamp("reference"), order.stamp("triton")
    assert "overridden_ops" not in ref and ref == order.ORDER.stamp("reference")
    with K.override({"token_logprobs": table.OPS["token_logprobs"].stock}):
        for backend, before in (("reference", ref), ("triton", tri)):
            now = order.stamp(backend)
            assert now["overridden_ops"] == ["token_logprobs"] and now["fingerprint"] != before["fingerprint"]
        assert order.stamp_for_device("cpu")["overridden_ops"] == ["token_logprobs"]
        # an explicit order inside cannot unmark it
        with order.override(order.CanonicalOrder(kv_block=32)):
            assert order.current().overridden_ops == ("token_logprobs",)
    assert order.stamp("reference") == ref and order.stamp("triton") == tri


def test_override_refuses_bad_arguments_and_other_threads():
    with pytest.raises(KeyError, match="not ops of the op table"):
        with K.override({"linaer": lambda: None}):
            pass
    with pytest.raises(TypeError, match="not callable"):
        with K.override({"linear": 3}):
            pass
    assert table.overridden() == {} and order.current() is order.ORDER
    errors = []
    with K.override({"linear": table.OPS["linear"].stock}):
        def other():
            try:
                with K.override({"rms_norm": table.OPS["rms_norm"].stock}):
                    pass
            except RuntimeError as e:
                errors.append(str(e))
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert errors and "another thread" in errors[0]
    assert table.overridden() == {}


def _op_bindings(path: Path):
    """(line, name) of every op a module binds by name from the kernels package (import-time binding
    an override cannot reach)."""
    sources = {"bitmatch.kernels"} | {f"bitmatch.kernels.{s.family}" for s in table.OPS.values()}
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module in sources or (node.level and node.module == "kernels")):
            out += [(node.lineno, a.name) for a in node.names if a.name in table.OPS]
    return out


def test_no_module_binds_an_op_by_name(tmp_path):
    """Callers reach ops as ``K.op`` (``import bitmatch.kernels as K``), so ``kernels.override`` reaches
    them; ``from bitmatch.kernels import linear`` would keep the canonical op inside an override.
    (Inside kernels/, an op composed of others binds them as part of its own definition.)"""
    probe = tmp_path / "probe.py"  # the check sees a binding (and not a triton module of the same name)
    probe.write_text("from bitmatch.kernels import linear\nfrom bitmatch.kernels.triton import linear as lin\n")
    assert _op_bindings(probe) == [(1, "linear")]
    files = [p for d in ("bitmatch", "benchmarks", "scripts", "examples") if (ROOT / d).exists()
             for p in (ROOT / d).rglob("*.py")]
    bound = [f"{p.relative_to(ROOT)}:{line} binds {name}" for p in files for line, name in _op_bindings(p)]
    assert not bound, "call these as K.<op> after `import bitmatch.kernels as K`: " + "; ".join(bound)


def test_the_engine_sampler_reaches_an_overridden_token_logprobs():
    """The sampler skips token_logprobs' argument checks by calling its autograd Function, except
    under an override: a fault or the stock baseline on token_logprobs reaches the engine too."""
    eng = Engine(tiny_model("qwen3", seed=0), block_size=16, num_gpu_blocks=32, max_num_seqs=2, seed=0)
    prompts = random_prompts(2, 4, 8, seed=0)
    sp = SamplingParams(temperature=0.8, max_tokens=3, seed=1, ignore_eos=True)
    calls = []

    def recorded(*a, **k):
        calls.append(a[0].shape)
        return table.OPS["token_logprobs"].canonical(*a, **k)
    want = [o.outputs[0].logprobs for o in eng.generate(prompts, sp, use_tqdm=False)]
    with K.override({"token_logprobs": recorded}):
        got = [o.outputs[0].logprobs for o in eng.generate(prompts, sp, use_tqdm=False)]
    assert calls and got == want  # the same op behind the recorder: the same bits


def test_faults_and_the_stock_baseline_go_through_the_override():
    assert {parse_inject(f"kernel:{op}")[1] for op in table.OPS} == set(table.OPS)
    with kernel_fault("rms_norm"):
        assert K.rms_norm is table.OPS["rms_norm"].stock
        assert order.stamp("reference")["overridden_ops"] == ["rms_norm"]
    assert table.overridden() == {}
    spec = importlib.util.spec_from_file_location("stock_ops", ROOT / "benchmarks" / "ops" / "stock_ops.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with bench.stock_ops() as replaced:
        assert set(replaced) == set(bench.BASELINE) == set(table.overridden())
        assert all(getattr(K, n) is table.OPS[n].stock for n in bench.BASELINE)
    assert table.overridden() == {} and order.current() is order.ORDER
