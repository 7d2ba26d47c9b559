"""The CPU decode-attention C kernel (kernels/cpu/decode_attention.py) against the eager fp32
reference: every head layout, head size (the specialized 64 and 128 and a generic one), block
size, window and element type; NaN wherever no token is; rows that lie apart; rows written in
place; threads; the build's cache and its failures; and the torch backend's choice of it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from paged_serve.engine.platform.cpu.attention import PlannedTorchAttention
from paged_serve.engine.platform.kernel_backend import make_kernels
from paged_serve.kernels.cpu import decode_attention as cpu_decode_attention
from paged_serve.kernels.cpu.decode_attention import CpuDecodeAttention
from paged_serve.kernels.reference import paged_attention_ref, write_kv_ref
from tests.engine.platform.cpu.test_cpu_attention import _batch

BF16_ULP = 2.0**-7  # bf16 keeps 8 significant bits: one rounding moves a value by < 2^-8 of it


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> CpuDecodeAttention:
    built = cpu_decode_attention.load(tmp_path_factory.mktemp("native"))
    assert built is not None, "the C kernel did not build (gcc is on every supported machine)"
    return built


def _decode_batch(contexts, heads, head_dim, block_size, dtype, seed=0):
    """One decode row per context (a context of ``c`` tokens: ``(0, c)`` in ``_batch``'s spec)."""
    return _batch([(1, (0, c)) for c in contexts], heads, head_dim, block_size, dtype, seed)


def _reference(batch, scale, window):
    return paged_attention_ref(
        batch.q.float(),
        batch.k_cache.float(),
        batch.v_cache.float(),
        **batch.kwargs(),
        scale=scale,
        sliding_window=window,
    )


def _assert_close_to_reference(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()  # the NaN where no token is never leaks in
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    else:  # one rounding of the fp32 result (the reference's own, rounded, may differ by one)
        torch.testing.assert_close(out.float(), ref, rtol=2 * BF16_ULP, atol=1e-6)


CASES = [
    # contexts, (Hq, Hkv), head_dim, block_size, window
    ([1], (4, 4), 64, 16, None),
    ([15, 16, 17], (9, 3), 64, 16, None),
    ([33, 1, 128, 7, 64, 5, 200], (8, 2), 128, 32, None),
    ([40, 9], (16, 2), 80, 8, None),
    ([300, 31], (9, 3), 64, 16, 17),
    ([12, 50, 3], (8, 1), 32, 4, 8),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("contexts,heads,head_dim,block_size,window", CASES)
def test_equals_the_fp32_reference(kernel, contexts, heads, head_dim, block_size, window, dtype):
    batch = _decode_batch(contexts, heads, head_dim, block_size, dtype)
    assert kernel.supports(batch.q, batch.k_cache, batch.v_cache)
    scale = head_dim**-0.5
    out = kernel.attend(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        scale=scale,
        sliding_window=window,
    )
    _assert_close_to_reference(out, _reference(batch, scale, window), dtype)


LONG_CASES = [
    # rows of more than PIECE_TOKENS (1024) positions: split into pieces, merged in order
    ([1025, 3000, 7, 1024], (9, 3), 64, 16, None, None),  # 2, 3, 1 and 1 pieces
    ([2100, 40], (8, 2), 128, 32, 1500, None),  # a window of 1500: 2 pieces
    ([2500], (4, 1), 80, 16, None, 2048),  # the chunk starts at 2048: one piece of 452
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("contexts,heads,head_dim,block_size,window,chunk", LONG_CASES)
def test_long_rows_split_into_pieces_equal_the_reference(
    kernel, contexts, heads, head_dim, block_size, window, chunk, dtype
):
    batch = _decode_batch(contexts, heads, head_dim, block_size, dtype)
    out = _attend(kernel, batch, sliding_window=window, attention_chunk=chunk)  # scale 0.125
    ref = paged_attention_ref(
        batch.q.float(),
        batch.k_cache.float(),
        batch.v_cache.float(),
        **batch.kwargs(),
        scale=0.125,
        sliding_window=window,
        attention_chunk=chunk,
    )
    _assert_close_to_reference(out, ref, dtype)


def test_a_long_row_gives_the_same_bits_alone_and_beside_others(kernel):
    """Its pieces are fixed by its own length, so neither its neighbours nor the thread count
    change its sums."""
    batch = _decode_batch([2600, 5, 1100, 300], (9, 3), 64, 16, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(kernel, batch)
        torch.set_num_threads(2)
        two = _attend(kernel, batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    alone = kernel.attend(
        batch.q[:1],
        batch.k_cache,
        batch.v_cache,
        block_tables=batch.block_tables[:1],
        seq_lens=batch.seq_lens[:1],
        scale=0.125,
    )
    assert torch.equal(alone[0], one[0])


CHUNK_CASES = [
    # contexts, (Hq, Hkv), head_dim, block_size, window, chunk
    ([1, 8, 9, 16, 17, 40], (8, 2), 64, 16, None, 8),  # chunk starts 0, 0, 8, 8, 16, 32
    ([300, 31, 64], (9, 3), 64, 16, 17, 32),  # the window's start or the chunk's, the later
    ([12, 50, 3], (8, 1), 32, 4, 8, 5),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("contexts,heads,head_dim,block_size,window,chunk", CHUNK_CASES)
def test_attention_chunk_equals_the_fp32_reference(
    kernel, contexts, heads, head_dim, block_size, window, chunk, dtype
):
    """A decode row (at ``len - 1``) sees no token before its chunk's start ``(len - 1) // C *
    C``; with a window too, the later of the two starts."""
    batch = _decode_batch(contexts, heads, head_dim, block_size, dtype)
    out = _attend(kernel, batch, sliding_window=window, attention_chunk=chunk)  # scale 0.125
    ref = paged_attention_ref(
        batch.q.float(),
        batch.k_cache.float(),
        batch.v_cache.float(),
        **batch.kwargs(),
        scale=0.125,
        sliding_window=window,
        attention_chunk=chunk,
    )
    _assert_close_to_reference(out, ref, dtype)


def test_the_torch_backend_takes_chunked_decode_steps(kernel, monkeypatch):
    """Decode-only steps of a chunked layer stay on the C kernel (chunk bound in place) and
    equal the reference; a step with a prefill chunk runs the plan, chunk bound in its mask."""
    calls = []
    real = kernel.attend

    def counted(*args, **kwargs):
        calls.append(kwargs.get("attention_chunk"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "attend", counted)
    planned = PlannedTorchAttention(decode_kernel=kernel)
    for spec, expected in (
        ([(1, (0, 20)), (1, (0, 70))], [8]),
        ([(1, (0, 20)), (5, (0, 30))], [8]),
    ):
        batch = _batch(spec, (8, 2), 64, 16, torch.float32)
        kwargs = dict(batch.kwargs(), scale=0.125, attention_chunk=8)
        out = planned.paged_attention(batch.q, batch.k_cache, batch.v_cache, **kwargs)
        ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, **kwargs)
        _assert_close_to_reference(out, ref, torch.float32)
        assert calls == expected


def _attend(kernel, batch, **extra):
    return kernel.attend(
        batch.q if "q" not in extra else extra.pop("q"),
        batch.k_cache,
        batch.v_cache,
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        scale=0.125,
        **extra,
    )


def test_rows_that_lie_apart_read_as_contiguous_ones(kernel):
    """q as the engine hands it in: the first heads of a fused q/k projection's rows."""
    batch = _decode_batch([20, 70, 5], (9, 3), 64, 16, torch.float32)
    wide = torch.cat((batch.q, torch.full((3, 3, 64), float("nan"))), dim=1)  # [S, 12, D]
    spaced = wide[:, :9]
    assert not spaced.is_contiguous() and kernel.supports(spaced, batch.k_cache, batch.v_cache)
    assert torch.equal(_attend(kernel, batch, q=spaced), _attend(kernel, batch))


def test_q_rows_pick_the_rows_and_out_keeps_the_others(kernel):
    batch = _decode_batch([20, 70, 5], (8, 2), 64, 16, torch.float32)
    alone = _attend(kernel, batch)
    q = torch.cat((torch.randn(2, 8, 64), batch.q))  # rows 2..4 are the sequences'
    out = torch.full_like(q, 7.0)
    got = _attend(kernel, batch, q=q, q_rows=torch.tensor([2, 3, 4]), out=out)
    assert got is out
    assert torch.equal(out[2:], alone) and (out[:2] == 7.0).all()


def test_one_thread_or_two_give_the_same_bits(kernel):
    """Each row (or piece of a long one) is one thread's work, so the thread count changes no
    sum's order."""
    batch = _decode_batch([100, 3, 47, 250, 16], (9, 3), 64, 16, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(kernel, batch)
        torch.set_num_threads(2)
        two = _attend(kernel, batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_unsupported_layouts_are_refused(kernel):
    batch = _decode_batch([20], (8, 2), 64, 16, torch.float32)
    k, v = batch.k_cache, batch.v_cache
    assert not kernel.supports(batch.q.half(), k.half(), v.half())  # fp16: no kernel
    assert not kernel.supports(batch.q, k.bfloat16(), v.bfloat16())  # mixed dtypes
    assert not kernel.supports(batch.q.transpose(1, 2).contiguous().transpose(1, 2), k, v)
    assert not kernel.supports(batch.q, k.transpose(1, 2), v.transpose(1, 2))
    assert not kernel.supports(batch.q[:, :5], k, v)  # 5 query heads over 2 KV heads
    assert not kernel.supports(batch.q[..., :32], k, v)  # a head size not the cache's


def test_the_build_is_cached_and_keyed(tmp_path: Path):
    first = cpu_decode_attention.load(tmp_path)
    assert first is not None
    built = list((tmp_path / "native").glob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_decode_attention._loaded.clear()  # a new process: the file is loaded, not rebuilt
    again = cpu_decode_attention.load(tmp_path)
    assert again is not None and again is not first
    assert built[0].stat().st_mtime_ns == stamp
    assert list((tmp_path / "native").glob("*")) == built  # no temporary file left behind


def test_a_failed_build_says_why_and_returns_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    with caplog.at_level(logging.WARNING, logger=cpu_decode_attention.__name__):
        assert cpu_decode_attention.load(tmp_path) is None
    assert "false failed" in caplog.text
    assert list((tmp_path / "native").glob("*")) == []
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_decode_attention._loaded.clear()
    assert cpu_decode_attention.load(tmp_path) is None


def test_the_torch_backend_takes_it_for_decode_only_steps(kernel, monkeypatch):
    calls = []
    real = kernel.attend

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "attend", counted)
    batch = _decode_batch([20, 70], (8, 2), 64, 16, torch.float32)
    kwargs = dict(batch.kwargs(), scale=0.125)
    planned = PlannedTorchAttention(decode_kernel=kernel)
    out = planned.paged_attention(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    assert calls == [2]
    _assert_close_to_reference(out, _reference(batch, 0.125, None), torch.float32)

    mixed = _batch([(1, (0, 20)), (5, (0, 30))], (8, 2), 64, 16, torch.float32)
    planned.paged_attention(mixed.q, mixed.k_cache, mixed.v_cache, **mixed.kwargs(), scale=0.125)
    assert calls == [2]  # a step with a prefill chunk runs the plan

    # An unquantized bf16 row alone keeps HF's layout (HF's own bf16 tokens); grouped, it goes.
    alone = _decode_batch([20], (8, 2), 64, 16, torch.bfloat16)
    for group_alone, expected in ((False, [2]), (True, [2, 1])):
        planned = PlannedTorchAttention(decode_kernel=kernel, group_alone=group_alone)
        planned.paged_attention(alone.q, alone.k_cache, alone.v_cache, **alone.kwargs(), scale=1.0)
        assert calls == expected


@pytest.mark.parametrize("window", [None, 5])
def test_a_non_causal_step_of_one_token_sequences_takes_it_alike(kernel, monkeypatch, window):
    """An encoder step whose sequences are one token each (a one-token prompt, or a row over a
    prefix) sees the same keys causal or not: the C kernel takes it and equals the non-causal
    reference."""
    calls = []
    real = kernel.attend

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "attend", counted)
    batch = _batch([(None, (0, 1)), (1, (0, 20)), (None, (0, 1))], (8, 2), 64, 16, torch.float32)
    kwargs = dict(batch.kwargs(), scale=0.125, sliding_window=window)
    planned = PlannedTorchAttention(decode_kernel=kernel)
    out = planned.paged_attention(batch.q, batch.k_cache, batch.v_cache, causal=False, **kwargs)
    assert calls == [3]
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, causal=False, **kwargs)
    _assert_close_to_reference(out, ref, torch.float32)


def test_the_cpu_backend_loads_it():
    """The engine's CPU backend has the kernel wherever it builds, so the engine tests (greedy
    equality with Hugging Face among them) run through it."""
    backend = make_kernels("torch")
    assert isinstance(backend.paged_attention.__self__.decode_kernel, CpuDecodeAttention)
    assert make_kernels("torch", decode_kernel=False).paged_attention.__self__.decode_kernel is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_equals_the_reference(kernel, dtype):
    """Rows to their slots, -1 skipped, from rows that lie apart (the engine's k is a split of
    the rotated q/k rows), the caches' other slots untouched."""
    torch.manual_seed(0)
    caches = [torch.randn(6, 4, 3, 16).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    rows = torch.randn(5, 12, 16).to(dtype)
    key, value = rows[:, 9:], rows[:, 6:9]  # [5, 3, 16], rows 192 elements apart
    slots = torch.tensor([3, -1, 23, 0, 9])
    assert kernel.supports_write(key, value, *caches)
    kernel.write_kv(key, value, *caches, slot_mapping=slots)
    write_kv_ref(key, value, *expected, slot_mapping=slots)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected))


def test_write_kv_refuses_what_it_cannot_take(kernel):
    k_cache, v_cache = torch.zeros(2, 4, 3, 16), torch.zeros(2, 4, 3, 16)
    key = torch.randn(2, 3, 16)
    assert not kernel.supports_write(key.bfloat16(), key.bfloat16(), k_cache, v_cache)
    assert not kernel.supports_write(key, key, k_cache[:, :2], v_cache[:, :2])
    assert not kernel.supports_write(
        key.transpose(0, 1).contiguous().transpose(0, 1), key, k_cache, v_cache
    )
    with pytest.raises(IndexError, match="outside"):
        kernel.write_kv(key, key, k_cache, v_cache, slot_mapping=torch.tensor([8, 1]))
    assert (k_cache.view(8, 3, 16)[1] == key[1]).all()  # the slot in range is written


def test_the_benchmark_checks_and_reports(tmp_path, capsys):
    from perf.cpu import bench_attention

    argv = ["--rows", "2", "--contexts", "20", "--layers", "2", "--rounds", "1"]
    bench_attention.main([*argv, "--cache-dir", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 + 2  # the header lines, then fp32 and bf16
    assert lines[-1].split()[:3] == ["bfloat16", "2", "20"]
