"""Train/serve equivalence of the TTT unroll, and the TTT mask."""

from __future__ import annotations

import copy

import pytest
import torch

import tritonspec as ts
from tritonspec.runtime.metadata import AttentionMetadata
from tritonspec.runtime.ops import TorchOps
from tritonspec.runtime.target import TargetModel
from tritonspec.runtime.tiny import tiny_target
from tritonspec.training.trainer import TrainConfig, build_drafter, capture, shared_teachers
from tritonspec.training.ttt import LOSS_DECAY, shift_left, teacher_from_logits, ttt_forward, ttt_mask

DEPTH = 4
T = 14


def test_ttt_mask_is_causal_plus_diagonal():
    m = ttt_mask(3, 2, torch.device("cpu"))
    assert m.shape == (3, 9)
    assert m[:, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    for i in (1, 2):
        assert torch.equal(m[:, 3 * i : 3 * i + 3], torch.eye(3, dtype=torch.bool))


def _setup(flags: bool):
    model = tiny_target("llama", seed=3)
    tm = TargetModel.from_pretrained(model, dtype=torch.float32)
    cfg = TrainConfig(fc_norm=flags, norm_output=flags, draft_vocab_size=60, ttt_depth=DEPTH, seed=1)
    seqs = [torch.randint(0, 97, (64,), generator=torch.Generator().manual_seed(0)).tolist()]
    d = build_drafter(tm, cfg, seqs)
    with torch.no_grad():  # non-trivial norm weights, so every norm is exercised
        for name, p in d.named_parameters():
            if p.ndim == 1:
                p.mul_(1 + 0.3 * torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model, tm, d


def _greedy_window(model, prompt_len: int) -> torch.Tensor:
    """A window whose tokens after ``prompt_len`` are the target's own greedy continuation."""
    prompt = torch.randint(0, 97, (prompt_len,), generator=torch.Generator().manual_seed(5)).tolist()
    rt = ts.SpeculativeRuntime.from_pretrained(model, None, backend="torch", max_seq_len=64)
    cont = rt.generate([prompt], max_new_tokens=T - prompt_len, speculative=False, stop_token_ids=[]).token_ids[0]
    return torch.tensor([prompt + cont])


def _serving_chain(model, drafter, window: torch.Tensor, t: int, depth: int) -> list[torch.Tensor]:
    """hn at each depth of serving-time chain drafting from position ``t``, fed the window's tokens.

    Prefill and catch-up over the prompt ``window[:t+1]`` and the chain steps use the runtime's
    target, drafter cache, slots, positions and mask layout exactly as ``SpeculativeRuntime``'s
    ``_prefill``/``_catch_up``/``_draft`` do for ``top_k=1``, but with teacher-forced tokens
    instead of the drafter's argmax.
    """
    rt = ts.SpeculativeRuntime.from_pretrained(
        model, drafter, backend="torch", max_seq_len=64, spec=ts.SpecConfig.chain(depth)
    )
    d, ops, P = rt.drafter, rt.ops, t + 1
    prompt = window[:, :P]
    with torch.inference_mode():
        pos = torch.arange(P)[None]
        causal = torch.ones(P, P, dtype=torch.bool).tril()[None]
        zero = torch.zeros(1, dtype=torch.int64)
        hidden, aux = rt.target.forward(ops, prompt, AttentionMetadata(pos, pos, zero, causal, P))
        root = rt.target.logits(hidden[:, -1]).argmax(-1)
        assert root.item() == window[0, P].item()  # the greedy window: root = x_{t+1}
        nxt = torch.cat([prompt[:, 1:], root[:, None]], dim=1)  # pairs (g_s, x_{s+1})
        g = d.combine(ops, aux.reshape(P, -1), torch.arange(P)).view(1, P, -1)
        hn, carry = d.step(ops, g, nxt, AttentionMetadata(pos, pos, zero, causal, P), rt.decoder.draft_cache)
        hns, hid = [hn[:, -1:]], carry[:, -1:]
        L = torch.tensor([P])
        width = depth - 1
        fmask = torch.zeros(1, 1, width, dtype=torch.bool)
        for s in range(1, depth):
            fmask = fmask.clone()
            fmask[0, 0, s - 1] = True
            tok = window[:, P + s : P + s + 1]
            slot = L[:, None] + s - 1
            hn, hid = d.step(ops, hid, tok, AttentionMetadata(slot, slot, L, fmask, P + width), rt.decoder.draft_cache)
            hns.append(hn)
    return [h[0, 0] for h in hns]


@pytest.mark.parametrize("flags", [False, True], ids=["eagle3", "eagle3.1"])
def test_train_serve_equivalence(flags):
    model, tm, d = _setup(flags)
    window = _greedy_window(model, prompt_len=5)
    tm.set_aux_layer_ids(d.config.aux_layer_ids)
    tm.allocate_cache(1, T)
    ops = TorchOps()
    aux, logits = capture(tm, ops, window)
    out = ttt_forward(d, ops, aux, window, DEPTH, logits)
    out.loss.backward()  # the training graph is a real one
    assert d.fc.weight.grad is not None and torch.isfinite(out.loss)
    for t in (4, 6, 8):
        chain = _serving_chain(model, copy.deepcopy(d), window, t, DEPTH)
        for j in range(DEPTH):
            torch.testing.assert_close(
                out.hn[j][0, t].detach(),
                chain[j],
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, j=j, t=t: f"depth {j}, position {t}: {m}",
            )


def test_carry_differs_between_variants():
    """The two flag settings really train different recurrences (guards against a dead flag)."""
    _, tm, d3 = _setup(False)
    _, _, d31 = _setup(True)
    d31.load_state_dict({k: v for k, v in d3.state_dict().items()}, strict=False)
    window = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(2))
    tm.set_aux_layer_ids(d3.config.aux_layer_ids)
    tm.allocate_cache(1, T)
    aux, _ = capture(tm, TorchOps(), window)
    with torch.no_grad():
        a = ttt_forward(d3, TorchOps(), aux, window, 2)
        b = ttt_forward(d31, TorchOps(), aux, window, 2)
    assert not torch.allclose(a.hn[1], b.hn[1])


def _per_depth_loss_reference(d, aux, window, depth, logits):
    """The loss as first written: each depth shifts the full-vocabulary logits, then takes their
    argmax and their softmax over the draft vocabulary (what ``Teacher`` now does once a batch)."""
    out = ttt_forward(d, TorchOps(), aux, window, depth)  # hn only
    used, T_ = d.target_ids(), window.shape[1]
    total, losses, accs = 0.0, [], []
    for j, hn in enumerate(out.hn):
        teacher = shift_left(logits, 1 + j)
        top = teacher.argmax(-1)
        valid = (torch.arange(T_) < T_ - 1 - j)[None, :] & d.t2d[top]
        p = torch.softmax(teacher.index_select(-1, used).float(), dim=-1)
        per_pos = -(p * torch.log_softmax(d.logits(hn).float(), dim=-1)).sum(-1)
        n = valid.sum()
        losses.append((per_pos * valid).sum() / n.clamp(min=1))
        accs.append((((used[d.logits(hn).argmax(-1)] == top) & valid).sum() / n.clamp(min=1)).item())
        total = total + LOSS_DECAY**j * losses[-1]
    return total, losses, accs


@pytest.mark.parametrize("flags", [False, True], ids=["eagle3", "eagle3.1"])
def test_teacher_once_a_batch_equals_the_per_depth_loss(flags):
    """A Teacher (argmax + draft-vocabulary softmax built once) gives the loss and accuracies of
    shifting the full logits at every depth bit for bit, and their gradient, given as logits or as a Teacher."""
    _, tm, d = _setup(flags)
    window = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(4))
    tm.set_aux_layer_ids(d.config.aux_layer_ids)
    tm.allocate_cache(2, T)
    aux, logits = capture(tm, TorchOps(), window)
    ref_total, ref_losses, ref_accs = _per_depth_loss_reference(d, aux, window, DEPTH, logits)
    ref_total.backward()
    ref_grad = d.fc.weight.grad.clone()
    for given in (logits, teacher_from_logits(logits, d.target_ids())):
        d.zero_grad()
        out = ttt_forward(d, TorchOps(), aux, window, DEPTH, given)
        out.loss.backward()
        assert torch.equal(out.loss, ref_total)
        assert all(torch.equal(a, b) for a, b in zip(out.losses, ref_losses))
        assert out.accuracies == ref_accs
        # the same gradient; autograd may sum a carry's two contributions in another order than in
        # the reference's graph (losses built after the unroll), hence a float32 tolerance here
        torch.testing.assert_close(d.fc.weight.grad, ref_grad, rtol=1e-5, atol=1e-7)
    # inverse: a teacher one position off changes the loss, so the comparison above can fail
    off = teacher_from_logits(shift_left(logits, 1), d.target_ids())
    assert not torch.equal(ttt_forward(d, TorchOps(), aux, window, DEPTH, off).loss, ref_total)


def test_shared_teachers_build_one_per_vocabulary_and_check_it():
    _, tm, d = _setup(True)
    window = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(6))
    tm.set_aux_layer_ids(d.config.aux_layer_ids)
    tm.allocate_cache(1, T)
    aux, logits = capture(tm, TorchOps(), window)
    used = d.target_ids()
    other = torch.arange(used.numel())
    a, b, c = shared_teachers(logits, [used, used.clone(), other])
    assert a is b and c is not a  # one build per distinct vocabulary
    assert torch.equal(c.used, other) and c.probs.shape == (1, T, used.numel())
    with pytest.raises(ValueError, match="another draft vocabulary"):
        ttt_forward(d, TorchOps(), aux, window, 2, c)
