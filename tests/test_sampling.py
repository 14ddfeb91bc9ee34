"""Lossless sampling: the joint distribution of the first generated tokens with speculation equals
direct sampling from the target; seeds reproduce; stop strings; streaming."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import tritonspec as ts
from tritonspec.runtime.sampling import SamplingParams, process_logits

from _util import perm_pair, random_prompts, runtime, tiny_target

SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, num_hidden_layers=4)
PROMPT = [1, 2, 0]


def exact_joint(model, prompt, n_tokens, sp: SamplingParams) -> dict[tuple, float]:
    """P(x1..xn) of the target under the processed distribution, by enumeration."""
    V = model.config.vocab_size
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=n_tokens - 1):
            logits = model(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1 :].float()
            probs = process_logits(logits, sp).softmax(-1)  # [n, V]
            p_prefix = math.prod(float(probs[i, seq[i]]) for i in range(n_tokens - 1))
            for last in range(V):
                out[seq + (last,)] = p_prefix * float(probs[n_tokens - 1, last])
    return out


def sample_joint(rt, n_samples, n_tokens, sp: SamplingParams, seed0=0, speculative=True) -> dict[tuple, int]:
    counts: dict[tuple, int] = {}
    B = rt.max_batch_size
    for call in range(n_samples // B):
        seeds = list(range(seed0 + call * B, seed0 + (call + 1) * B))
        out = rt.generate(
            [PROMPT] * B,
            max_new_tokens=n_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            seed=seeds,
            speculative=speculative,
        )
        for row in out.token_ids:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts


def chi_square(counts: dict[tuple, int], probs: dict[tuple, float], min_expected: float = 5.0) -> tuple[float, float]:
    """Pearson statistic over cells (small cells pooled) and its 1e-4 critical value (Wilson-Hilferty)."""
    n = sum(counts.values())
    stat, df, pool_o, pool_e = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        e, o = n * p, counts.get(cell, 0)
        if e < min_expected:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    assert sum(c for k, c in counts.items() if k not in probs) == 0
    z = 3.719  # one-sided 1e-4
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def bias_power(probs: dict[tuple, float], n: int) -> float:
    """Expected chi-square excess if 2% of mass moved between the two likeliest cells."""
    a, b = sorted(probs.values(), reverse=True)[:2]
    return n * (0.02**2 / a + 0.02**2 / b)


CASES = {
    "random-drafter": dict(kind="random", sp=SamplingParams(temperature=1.0)),
    "draft-vocab-subset": dict(kind="subset", sp=SamplingParams(temperature=1.0)),
    "good-drafter": dict(kind="perm", sp=SamplingParams(temperature=1.5)),
    "good-drafter-top-p-top-k": dict(kind="perm", sp=SamplingParams(temperature=2.0, top_p=0.9, top_k=3)),
}


def make_case(kind):
    if kind == "random":
        model = tiny_target("llama", seed=11, vocab_size=4, **SMALL)
        return model, ts.Eagle3Drafter.for_target(model.config, seed=3)
    if kind == "subset":  # a draft vocabulary of 3 of the 4 target ids, not a prefix: d2t is not the identity
        model = tiny_target("llama", seed=11, vocab_size=4, **SMALL)
        d = ts.Eagle3Drafter.for_target(model.config, seed=3, draft_vocab_size=3)
        d.set_draft_vocab(torch.tensor([0, 2, 3]))
        return model, d
    return perm_pair("llama", vocab=4, seed=2, alpha=0.5)


N_SAMPLES = 12_288  # end to end; the op-level test below uses 200k samples


# ---------------------------------------------------------------- the verification op alone
TREES = {  # parents per node (node 0 = root), tokens per node
    "chain": ([-1, 0, 1, 2], [0, 1, 2, 3]),
    "siblings": ([-1, 0, 0, 0], [0, 2, 0, 3]),
    "mixed": ([-1, 0, 0, 1, 1, 2, 3], [0, 1, 2, 0, 3, 1, 2]),
    "duplicate-siblings": ([-1, 0, 0, 1], [0, 1, 1, 2]),
}


def tree_output_distribution(parents, tokens, probs, max_depth):
    """Exact distribution of one round's emitted tokens: the target's, cut at the first token that
    leaves the tree (or at max depth)."""
    out = {}

    def walk(node, depth, prefix, p):
        children = {}
        for j in range(1, len(parents)):
            if parents[j] == node and tokens[j] not in children:
                children[tokens[j]] = j  # the first child carrying a token wins
        for v in range(probs.shape[-1]):
            q = p * float(probs[node, v])
            if v in children and depth < max_depth:
                walk(children[v], depth + 1, prefix + (v,), q)
            elif q > 0:
                out[prefix + (v,)] = out.get(prefix + (v,), 0.0) + q

    walk(0, 0, (), 1.0)
    return out


def run_op(fn, parents, tokens, probs, n, max_depth, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, V = probs.shape
    tok = torch.tensor(tokens).expand(n, N)
    par = torch.tensor(parents).expand(n, N)
    u = torch.rand(n, N, generator=g)
    xi = torch.empty(n, V).exponential_(generator=g)
    nodes, num, emitted = fn(tok, par, probs.expand(n, N, V), u, xi, max_depth)
    counts: dict[tuple, int] = {}
    for row, k in zip(emitted.tolist(), num.tolist()):
        counts[tuple(row[: k + 1])] = counts.get(tuple(row[: k + 1]), 0) + 1
    return counts


@pytest.mark.parametrize("tree", list(TREES))
def test_verify_sampling_op_is_lossless(tree):
    from tritonspec.kernels.verify_sampling import verify_sampling_reference

    parents, tokens = TREES[tree]
    g = torch.Generator().manual_seed(len(tree))
    probs = torch.softmax(torch.randn(len(parents), 4, generator=g) * 1.5, -1)
    probs[0, 3] = 0.0  # a zero-probability child must never be accepted
    probs[0] /= probs[0].sum()
    max_depth = max(1, max(len(parents) - 1, 1))
    exact = tree_output_distribution(parents, tokens, probs, max_depth)
    n = 200_000
    stat, crit = chi_square(run_op(verify_sampling_reference, parents, tokens, probs, n, max_depth), exact)
    assert stat < crit, f"{tree}: chi2={stat:.1f} > {crit:.1f}"
    assert bias_power(exact, n) > 3 * crit, "sample size too small to catch a 2% bias"
    if tree in ("siblings", "mixed"):  # inverse: with distinct siblings, no renormalisation is biased
        stat, crit = chi_square(run_op(_no_renorm_fast, parents, tokens, probs, n, max_depth), exact)
        assert stat > crit, f"{tree}: the wrong rule went undetected (chi2={stat:.1f})"


def _no_renorm_fast(tokens, parents, probs, uniforms, exp_noise, max_depth):
    """A classic mistake: after a sibling is rejected, the next sibling is still accepted with its
    original probability p(c) instead of p(c) / (1 - rejected mass). Otherwise the reference."""
    B, N = tokens.shape
    rows = torch.arange(B)
    nodes = torch.full((B, max_depth + 1), -1, dtype=torch.int64)
    emitted = torch.full((B, max_depth + 1), -1, dtype=torch.int64)
    nodes[:, 0] = 0
    cur = torch.zeros(B, dtype=torch.int64)
    num = torch.zeros(B, dtype=torch.int64)
    r = probs[:, 0].clone()
    for j in range(1, N):
        tok = tokens[:, j]
        is_child = (parents[:, j] == cur) & (num < max_depth)
        pc = r[rows, tok]
        accept = is_child & (pc > 0) & (uniforms[:, j] <= probs[rows, cur, tok])  # BUG: original p
        reject = is_child & ~accept
        r[rows, tok] = torch.where(reject, 0.0, pc)
        r = torch.where(accept[:, None], probs[:, j], r)
        d = (num + 1).clamp(max=max_depth)
        nodes.scatter_(1, d[:, None], torch.where(accept, j, nodes.gather(1, d[:, None])[:, 0])[:, None])
        emitted.scatter_(1, num[:, None], torch.where(accept, tok, emitted.gather(1, num[:, None])[:, 0])[:, None])
        cur = torch.where(accept, j, cur)
        num = num + accept.long()
    emitted.scatter_(1, num[:, None], (r.log() - exp_noise.log()).argmax(-1)[:, None])
    return nodes, num, emitted


SHAPES = {
    "tree": ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6),
    "sampled-chain": ts.SpecConfig(num_speculative_tokens=3, top_k=1, num_draft_tokens=4),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_matches_target_distribution(name, shape):
    case = CASES[name]
    model, drafter = make_case(case["kind"])
    rt = runtime(model, drafter, SHAPES[shape], max_batch_size=1024, max_seq_len=12)
    probs = exact_joint(model, PROMPT, 3, case["sp"])
    counts = sample_joint(rt, N_SAMPLES, 3, case["sp"])
    stat, crit = chi_square(counts, probs)
    assert stat < crit, f"speculative samples deviate from the target: chi2={stat:.1f} > {crit:.1f}"
    assert (
        rt.generate(
            [PROMPT] * 64, max_new_tokens=3, temperature=case["sp"].temperature, seed=list(range(64))
        ).stats.num_accepted_tokens
        > 0
    )


def _no_residual(tokens, probs, draft_probs, uniforms, exp_noise):
    from tritonspec.kernels.verify_chain import verify_chain_reference

    nodes, num, emitted = verify_chain_reference(tokens, probs, draft_probs, uniforms, exp_noise)
    rows = torch.arange(tokens.shape[0])
    bonus = (probs[rows, num] / exp_noise).argmax(-1)  # BUG: p, not max(0, p - q), after a rejection
    return nodes, num, emitted.scatter(1, num[:, None], bonus[:, None])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_wrong_acceptance_rule_fails_the_same_test(shape):
    """Inverse test: the end-to-end distribution test has teeth."""
    model, drafter = make_case("perm")
    sp = CASES["good-drafter"]["sp"]
    rt = runtime(model, drafter, SHAPES[shape], max_batch_size=1024, max_seq_len=12)
    rt.ops.verify_sampling = _no_renorm_fast
    rt.ops.verify_chain = _no_residual
    stat, crit = chi_square(sample_joint(rt, N_SAMPLES, 3, sp), exact_joint(model, PROMPT, 3, sp))
    assert stat > crit, f"a biased rule went undetected: chi2={stat:.1f} <= {crit:.1f}"


def test_plain_sampling_matches_target_distribution():
    model, _ = make_case("random")
    sp = SamplingParams(temperature=0.8, top_p=0.95)
    rt = runtime(model, None, max_batch_size=1024, max_seq_len=12)
    stat, crit = chi_square(
        sample_joint(rt, N_SAMPLES // 2, 2, sp, speculative=False), exact_joint(model, PROMPT, 2, sp)
    )
    assert stat < crit


def test_seed_reproduces_and_rows_are_batch_independent():
    model, drafter = perm_pair("llama", vocab=24, seed=1, alpha=0.3)
    rt = runtime(model, drafter, ts.SpecConfig(3, 3, 10))
    prompts = random_prompts(24, [5, 9, 2], seed=0)
    a = rt.generate(prompts, max_new_tokens=20, temperature=0.9, seed=[7, 8, 9])
    b = rt.generate(prompts, max_new_tokens=20, temperature=0.9, seed=[7, 8, 9])
    assert a.token_ids == b.token_ids
    assert rt.generate([prompts[1]], max_new_tokens=20, temperature=0.9, seed=8).token_ids[0] == a.token_ids[1]
    c = rt.generate(prompts, max_new_tokens=20, temperature=0.9, seed=[1, 2, 3])
    assert c.token_ids != a.token_ids


def test_temperature_to_zero_is_greedy():
    model, drafter = perm_pair("llama", vocab=24, seed=1, alpha=0.3)
    rt = runtime(model, drafter, ts.SpecConfig(3, 3, 10))
    prompts = random_prompts(24, [5, 9], seed=3)
    greedy = rt.generate(prompts, max_new_tokens=24).token_ids
    assert rt.generate(prompts, max_new_tokens=24, temperature=1e-4, seed=0).token_ids == greedy
    assert rt.generate(prompts, max_new_tokens=24, temperature=1e-4, seed=0, speculative=False).token_ids == greedy


def test_bad_sampling_input():
    model, drafter = perm_pair("llama", vocab=24, seed=1)
    rt = runtime(model, drafter)
    for kw, msg in [
        (dict(temperature=-0.5), "temperature=-0.5 must be >= 0"),
        (dict(temperature=1.0, top_p=0.0), r"top_p=0.0 must lie in \(0, 1\]"),
        (dict(temperature=1.0, top_p=1.5), r"top_p=1.5 must lie in \(0, 1\]"),
        (dict(top_k=-1), "top_k=-1 must be >= 0"),
        (dict(seed=[1, 2]), "2 seeds for 1 prompts"),
    ]:
        with pytest.raises(ValueError, match=msg):
            rt.generate([[1, 2]], **kw)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        rt.generate([[1, 2]], stop=["x"])
