"""bfloat16 linear layers on AMX (issue 21): weights packed into AMX tiles at load
(``weight_layout="amx"``, ``kernels.cpu_linear.pack_bf16``) run ``kernels/cpu/linear.c``'s TDPBF16PS
path. A row's result is bit-identical at any row count, among any other rows and on any thread count
(so speculative greedy output equals plain output by construction), close to the float32 product,
the packed weights replace the originals, and the layout is chosen where AMX runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import tritonspec as ts
from tritonspec.kernels import cpu_linear as cl
from tritonspec.runtime.target import resolve_layout

from _util import perm_pair, random_prompts, tiny_target

AMX = cl.amx_available()
needs_amx = pytest.mark.skipif(AMX is not None, reason=f"no AMX bfloat16 here ({AMX}): the packed path cannot run")
# every projection packable: K % 32 == 0 and N % 16 == 0 (head_dim 16)
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def bf16(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


# ----------------------------------------------------------------------------- the packed layout
@needs_amx
@settings(max_examples=25, deadline=None)
@given(nb=st.integers(1, 7), kb=st.integers(1, 5), seed=st.integers(0, 1000))
def test_pack_layout_and_roundtrip(nb, kb, seed):
    w = bf16(16 * nb, 32 * kb, seed=seed)
    wp = cl.pack_bf16(w)
    assert wp.shape == (nb, kb, 16, 32) and wp.is_contiguous() and cl.is_packed(wp)
    assert cl.out_features(wp) == 16 * nb and torch.equal(cl.unpack(wp), w)
    g = torch.Generator().manual_seed(seed)
    for _ in range(20):  # wp[nb, kb, p, 2j + i] = w[16 nb + j, 32 kb + 2p + i]
        n, k = (int(torch.randint(0, s, (1,), generator=g)) for s in w.shape)
        assert wp[n // 16, k // 32, (k % 32) // 2, (n % 16) * 2 + k % 2] == w[n, k]


# ----------------------------------------------------------------------------- the kernel
@needs_amx
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (960, 576), (576, 1536), (112, 64)])
@pytest.mark.parametrize("rows", [1, 3, 7, 16, 17, 99])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float32(shape, rows, bias):
    N, K = shape
    w, x = bf16(N, K, seed=1, scale=K**-0.5), bf16(rows, K, seed=2)
    b = bf16(N, seed=3) if bias else None
    y = cl.cpu_linear(x, cl.pack_bf16(w), b)
    assert y.shape == (rows, N) and y.dtype == torch.bfloat16
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    # float32 accumulation, one bfloat16 rounding of the result (relative 2^-8), plus the sum's order
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max().item())


@needs_amx
@settings(max_examples=30, deadline=None)
@given(
    nb=st.integers(1, 9),
    kb=st.integers(1, 6),
    rows=st.one_of(st.integers(1, 70), st.integers(250, 300)),  # 256-row chunks: across a chunk's end
    row=st.integers(0, 299),
    seed=st.integers(0, 10_000),
    threads=st.sampled_from([1, 2, 3]),
)
def test_a_row_is_the_same_at_any_row_count_among_any_rows(nb, kb, rows, row, seed, threads):
    """Row ``row`` computed alone, among ``rows`` random others, and on another thread count: the same
    bits (the tile's other rows, the configured row count and the column split do not enter it)."""
    row %= rows
    w = cl.pack_bf16(bf16(16 * nb, 32 * kb, seed=seed, scale=0.2))
    b = bf16(16 * nb, seed=seed + 1)
    x = bf16(rows, 32 * kb, seed=seed + 2)
    alone = cl.cpu_linear(x[row : row + 1], w, b, threads=1)
    among = cl.cpu_linear(x, w, b, threads=threads)[row : row + 1]
    others = x.clone()
    others[torch.arange(rows) != row] = bf16(rows - 1, 32 * kb, seed=seed + 3)
    assert torch.equal(alone, among)
    assert torch.equal(alone, cl.cpu_linear(others, w, b, threads=threads)[row : row + 1])
    assert torch.equal(among, cl._launch_ctypes(x, w, b, threads)[row : row + 1])  # native = ctypes


@needs_amx
def test_the_avx512_and_amx_sequences_round_differently():
    """The inverse of the invariance tests: the two bfloat16 paths give different bits for the same
    values, so the bit-equality checks above would catch a process that mixed them on one weight
    (it never does: a packed weight runs AMX only, an unpacked one AVX-512 only)."""
    w, x = bf16(576, 1536, seed=5, scale=1536**-0.5), bf16(8, 1536, seed=6)
    avx, amx = cl.cpu_linear(x, w), cl.cpu_linear(x, cl.pack_bf16(w))
    torch.testing.assert_close(amx.float(), avx.float(), rtol=2**-7, atol=1e-2)
    assert not torch.equal(avx, amx)


@needs_amx
def test_packed_weights_in_compiled_graphs_give_eager_bits():
    """The native operator with a packed weight under torch.compile (fake tensor shape, opaque op)."""
    assert cl.native_op() is None
    w, x = cl.pack_bf16(bf16(96, 64, seed=7)), bf16(5, 64, seed=8)
    fn = torch.compile(lambda a: torch.nn.functional.silu(cl.linear(a, w)), fullgraph=True)
    assert torch.equal(fn(x), torch.nn.functional.silu(cl.linear(x, w)))


@needs_amx
def test_packed_weight_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"cannot pack .* K % 32 == 0"):
        cl.pack_bf16(bf16(16, 72))
    with pytest.raises(ValueError, match="cannot pack a torch.float32"):
        cl.pack_bf16(torch.randn(16, 32))
    wp = cl.pack_bf16(bf16(16, 64))
    with pytest.raises(ValueError, match="does not match x's K=32"):
        cl.cpu_linear(bf16(2, 32), wp)
    x = bf16(2, 64).requires_grad_()
    with pytest.raises(ValueError, match="no autograd"):
        cl.linear(x, wp)


def test_amx_switched_off_by_the_environment_falls_back_to_the_loaded_layout():
    code = textwrap.dedent(
        """
        import torch
        from tritonspec.kernels import cpu_linear as cl
        from tritonspec.runtime.target import resolve_layout
        print(cl.amx_available())
        print(resolve_layout("auto", torch.device("cpu"), torch.bfloat16))
        """
    )
    env = {**os.environ, "TRITONSPEC_CPU_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    why, layout = out.stdout.split("\n")[:2]
    assert why != "None" and layout != "amx"
    if AMX is None:
        assert why == "TRITONSPEC_CPU_AMX=0"


# ----------------------------------------------------------------------------- the target
@needs_amx
def test_auto_layout_is_amx_for_bfloat16_only():
    cpu = torch.device("cpu")
    assert resolve_layout("auto", cpu, torch.bfloat16) == "amx"
    assert resolve_layout("auto", cpu, torch.float32) != "amx"
    assert resolve_layout("auto", cpu, torch.bfloat16, cpu_linear="torch") != "amx"
    with pytest.raises(ts.UserError, match="weight_layout='amx' cannot run here: it packs bfloat16"):
        resolve_layout("amx", cpu, torch.float32)
    with pytest.raises(ts.UserError, match="CPU kernels are off"):
        resolve_layout("amx", cpu, torch.bfloat16, cpu_linear="torch")


def storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@needs_amx
@pytest.mark.parametrize("tied", [True, False])
def test_packed_target_replaces_the_originals_and_saves_them(tmp_path, tied):
    src, out = tmp_path / "src", tmp_path / "out"
    tiny_target("qwen2", seed=1, vocab_size=96, tie_word_embeddings=tied, **SMALL).save_pretrained(str(src))
    original = load_file(str(src / "model.safetensors"))
    tm = ts.TargetModel.from_pretrained(src, dtype=torch.bfloat16)
    assert tm.weight_layout == "amx"
    L = tm.layers[0]
    assert all(cl.is_packed(t) for t in (L.wqkv, L.wo, L.gate_up, L.down, tm.lm_head)) and tm.embed.dim() == 2
    held = [tm.embed, tm.lm_head, tm.norm] + [t for L in tm.layers for t in vars(L).values() if torch.is_tensor(t)]
    nbytes = sum(t.numel() * 2 for t in original.values())
    # the tied head is the one extra copy (packed); nothing else is held twice
    assert storage_bytes(held) == nbytes + (tm.embed.numel() * 2 if tied else 0)
    tm.save_pretrained(out)
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == original.keys()
    for k, v in original.items():
        assert torch.equal(saved[k], v.bfloat16()), k


@needs_amx
@pytest.mark.parametrize("spec", [ts.SpecConfig.chain(3), ts.SpecConfig(3, 2, 6)], ids=["chain", "tree"])
def test_speculative_equals_plain_over_packed_weights(spec):
    """Greedy speculative = plain bit for bit (batch 1 and 4); seeded sampling: each prompt's output
    alone = in the batch. Over ~200 random prompts in all."""
    model, drafter = perm_pair("llama", vocab=32, seed=1, alpha=0.15, target_overrides=SMALL)
    tm = ts.TargetModel.from_pretrained(model, dtype=torch.bfloat16)
    assert tm.weight_layout == "amx" and cl.is_packed(tm.layers[0].wqkv)
    rt = ts.SpeculativeRuntime(tm, drafter.to(torch.bfloat16), None, spec=spec, max_batch_size=4, max_seq_len=128)
    taus = []
    for seed in range(12):
        prompts = random_prompts(32, [2 + seed % 5, 9, 1, 17], seed=seed)
        for batch in (prompts[:1], prompts):
            out = rt.generate(batch, max_new_tokens=24)
            assert out.token_ids == rt.generate(batch, max_new_tokens=24, speculative=False).token_ids
            taus.append(out.stats.mean_acceptance_length)
        if seed < 3:
            both = rt.generate(prompts, max_new_tokens=16, temperature=1.0, seed=[11, 12, 13, 14]).token_ids
            alone = [
                rt.generate([p], max_new_tokens=16, temperature=1.0, seed=s).token_ids[0]
                for p, s in zip(prompts, [11, 12, 13, 14])
            ]
            assert both == alone
    assert sum(taus) / len(taus) > 1.5  # the drafter is accepted: the comparison is not vacuous


@needs_amx
def test_deterministic_mode_runs_packed_weights_as_the_kernel():
    model, drafter = perm_pair("llama", vocab=32, seed=2, target_overrides=SMALL)
    tm = ts.TargetModel.from_pretrained(model, dtype=torch.bfloat16)
    rt = ts.SpeculativeRuntime(
        tm, drafter.to(torch.bfloat16), None, max_batch_size=4, max_seq_len=96, deterministic=True
    )
    probes = [p for p in rt.ops.probes if p.op == "linear" and p.layout == "amx"]
    assert len(probes) >= 4 and all(p.method == "kernel" for p in probes)
    assert {p.shape for p in probes} >= {(128, 64), (64, 64), (256, 64), (64, 128)}  # [N, K], not the packed dims
    prompts = random_prompts(32, [3, 8, 1, 12], seed=5)
    out = rt.generate(prompts, max_new_tokens=16)
    assert out.token_ids == [rt.generate([p], max_new_tokens=16, speculative=False).token_ids[0] for p in prompts]


@needs_amx
def test_tuned_profiles_find_a_packed_target():
    """A target's fingerprint (the key of its tuned tree profiles) reads the weights' values, so it is
    the same packed or not (inverse: another target's differs)."""
    from tritonspec.runtime.profiles import target_fingerprint

    model = tiny_target("llama", seed=4, vocab_size=96, **SMALL)
    fp = {lay: target_fingerprint(ts.TargetModel.from_pretrained(model, dtype=torch.bfloat16, weight_layout=lay))
          for lay in ("amx", "nk")}  # fmt: skip
    assert fp["amx"] == fp["nk"]
    other = tiny_target("llama", seed=5, vocab_size=96, **SMALL)
    assert target_fingerprint(ts.TargetModel.from_pretrained(other, dtype=torch.bfloat16)) != fp["amx"]
