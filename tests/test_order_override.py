"""order.override: the active canonical order itself is swapped, so the stamp follows it, the
launchers read it at launch, overrides nest and the previous order is back on any exit."""
import threading

import pytest

from bitmatch.kernels import order
from bitmatch.kernels.order import ORDER, CanonicalOrder
from bitmatch.kernels.triton import attention as TA, linear as TL, logprobs as TLP, norm as TN


def test_override_changes_the_stamp_and_restores_it():
    tri, ref = order.stamp("triton"), order.stamp("reference")
    assert order.current() is ORDER and tri == ORDER.stamp("triton")
    with order.override(kv_partition=256) as o:
        assert order.current() is o and o.kv_partition == 256
        assert order.stamp("triton")["fingerprint"] != tri["fingerprint"]
        assert order.stamp("triton")["kv_partition"] == 256
        assert order.stamp("reference") == ref  # the reference walks no KV partitions
        assert order.stamp_for_device("cpu") == ref
    assert order.current() is ORDER and order.stamp("triton") == tri


@pytest.mark.parametrize("field,value,backend", [
    ("version", 2, "reference"), ("exact_grid_bits", 18, "reference"), ("exact_k_chunk", 2048, "reference"),
    ("kv_block", 32, "triton"), ("rowsum_mma", False, "triton"), ("linear_split_table", (), "triton"),
    ("linear_chunk_align", 128, "triton"), ("norm_warps", ((1 << 62, 4),), "triton"),
    ("logprobs_block_v", 2048, "triton"), ("logprobs_warps", 4, "triton"),
    ("op_versions", (("linear", 2),), "reference"), ("op_versions", (("linear", 2),), "triton")])
def test_every_bit_fixing_field_is_in_its_backends_stamp(field, value, backend):
    with order.override(**{field: value}):
        assert order.stamp(backend)["fingerprint"] != ORDER.stamp(backend)["fingerprint"]


def test_overrides_nest_and_restore_in_order():
    with order.override(kv_block=32):
        with order.override(kv_partition=256):
            o = order.current()
            assert (o.kv_block, o.kv_partition) == (32, 256)  # the inner one starts from the outer
            with order.override(CanonicalOrder(version=3)):
                assert order.current() == CanonicalOrder(version=3)
            assert order.current() is o
        assert (order.current().kv_block, order.current().kv_partition) == (32, ORDER.kv_partition)
    assert order.current() is ORDER


def test_override_restores_on_exception():
    with pytest.raises(ZeroDivisionError):
        with order.override(kv_block=32):
            with order.override(rowsum_mma=False):
                1 / 0
    assert order.current() is ORDER
    with pytest.raises(TypeError, match="unknown field"):
        with order.override(kv_blok=32):
            pass
    assert order.current() is ORDER


def test_override_is_process_wide_and_refuses_a_second_thread():
    seen, errors = [], []

    def other():
        seen.append(order.current().kv_block)  # a launch from another thread runs the override
        try:
            with order.override(kv_block=16):
                pass
        except RuntimeError as e:
            errors.append(str(e))

    with order.override(kv_block=32):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == [32] and errors and "another thread" in errors[0]
    t = threading.Thread(target=other)  # no override held: the thread may take one
    t.start()
    t.join()
    assert seen[-1] == ORDER.kv_block and len(errors) == 1 and order.current() is ORDER


def test_launchers_read_the_order_at_launch():
    """No module-level copies left to go stale, and each launcher follows the override."""
    for mod, names in ((TA, ("KV_BLOCK", "KV_PARTITION", "ROWSUM_MMA", "MIN_BLOCK_M_CUDA")),
                       (TL, ("SPLIT_TABLE", "_CHUNK_ALIGN")), (TLP, ("BLOCK_V",))):
        assert not [n for n in names if hasattr(mod, n)], mod.__name__
    assert TL.split_for(64, 512) == 1
    with order.override(linear_split_table=(((64, 512), 2),)):
        assert TL.split_for(64, 512) == 2
        with order.override(linear_chunk_align=512):
            assert TL.split_for(64, 512) == 1  # a 256-long chunk no longer holds whole 512 blocks
    assert TN._block_and_warps(4096) == (4096, 8)
    with order.override(norm_warps=((1 << 62, 4),)):
        assert TN._block_and_warps(4096) == (4096, 4)
    from bitmatch.kernels import _exact
    with order.override(exact_grid_bits=16, exact_k_chunk=256):
        assert (_exact.grid_bits(), _exact.k_chunk()) == (16, 256)
    assert (_exact.grid_bits(), _exact.k_chunk()) == (20, 4096)


def test_inexact_grid_is_refused():
    with pytest.raises(ValueError, match="not exact in float64"):
        CanonicalOrder(exact_grid_bits=24)
