"""The Llama-style GPT: shapes, causality, deterministic init, and its config knobs."""

from __future__ import annotations

import math

import pytest
import torch

from common.errors import BadConfig
from spec import ModelConfig
from trainer.model import (
    GPT,
    IGNORE,
    block_causal_mask,
    choose_attention,
    cu_seqlens,
    ffn_hidden,
    packed_mode,
    param_groups,
)

V = 97


def cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16),
                          **kw})


def tokens(b=2, t=16, seed=0) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def test_forward_returns_logits_per_position_and_scalar_loss_near_log_vocab_at_init():
    model = GPT(cfg(), V, seed=0)
    x = tokens()
    logits, loss = model(x, tokens(seed=1))
    assert logits.shape == (2, 16, V)
    assert loss.shape == ()
    assert abs(loss.item() - math.log(V)) < 0.5  # near-uniform predictions at init
    assert model(x)[1] is None


def test_changing_a_later_token_does_not_change_earlier_logits():
    model = GPT(cfg(), V, seed=0).eval()
    x = tokens()
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % V
    a, _ = model(x)
    b, _ = model(y)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_same_seed_builds_identical_weights_and_other_seed_differs():
    a, b, c = (GPT(cfg(), V, seed=s).state_dict() for s in (3, 3, 4))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])


def test_init_does_not_consume_the_global_torch_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    GPT(cfg(), V, seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_swiglu_hidden_is_two_thirds_of_ffn_mult_rounded_up_to_64():
    assert ffn_hidden(cfg(d_model=128, n_heads=4, n_kv_heads=4)) == 384  # 341.3 -> 384
    assert ffn_hidden(cfg(d_model=96, n_heads=4, n_kv_heads=4)) == 256  # 256 exactly
    assert GPT(cfg(), V).blocks[0].ffn.w1.weight.shape == (128, 32)  # 85.3 -> 128


def test_gqa_projects_keys_and_values_to_fewer_heads():
    attn = GPT(cfg(n_heads=4, n_kv_heads=2), V).blocks[0].attn
    assert attn.wq.weight.shape == (32, 32)
    assert attn.wk.weight.shape == attn.wv.weight.shape == (16, 32)


def test_tied_embeddings_share_one_tensor_and_count_once():
    tied, untied = GPT(cfg(tie_embeddings=True), V), GPT(cfg(tie_embeddings=False), V)
    assert tied.lm_head.weight is tied.embed.weight
    assert untied.param_count() - tied.param_count() == V * 32
    assert tied.param_count() == sum(p.numel() for p in tied.parameters())


def test_no_linear_layer_has_a_bias():
    model = GPT(cfg(), V)
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    x, y = tokens(), tokens(seed=1)
    grads = []
    for ckpt in (False, True):
        model = GPT(cfg(activation_checkpointing=ckpt), V, seed=0)
        _, loss = model(x, y)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[0][1], grads[1][1]))


def test_flash_attention_without_cuda_is_a_bad_config_naming_the_field():
    with pytest.raises(BadConfig) as err:
        choose_attention("flash", cuda=False)
    assert err.value.field == "model.attention"
    assert choose_attention("auto", cuda=False) == "sdpa"
    assert choose_attention("sdpa", cuda=True) == "sdpa"


def test_norm_gains_are_excluded_from_weight_decay():
    decay, no_decay = param_groups(GPT(cfg(), V), 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert len(no_decay["params"]) == 2 * 2 + 1  # two norms per block plus the final norm


def test_a_few_adam_steps_lower_the_loss_on_a_fixed_batch():
    model = GPT(cfg(), V, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = tokens(), tokens(seed=1)
    first = model(x, y)[1].item()
    for _ in range(20):
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    assert model(x, y)[1].item() < first - 0.5


# ---- packed rows: several documents per row, no attention across them -------------------
def packed_row(docs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One (1, T) row of the documents back to back, with per-document positions and ids."""
    idx = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(d.numel()) for d in docs])[None]
    doc = torch.cat([torch.full((d.numel(),), i) for i, d in enumerate(docs)])[None]
    return idx, pos, doc


@pytest.mark.parametrize("mode", ["mask", "segments"])
def test_each_packed_document_has_the_logits_it_has_alone(mode):
    model = GPT(cfg(), V, seed=0).eval()
    model.packed_sdpa = mode
    docs = [tokens(1, n, seed=n)[0] for n in (5, 7, 4)]  # 16 tokens = seq_len
    idx, pos, doc = packed_row(docs)
    with torch.no_grad():
        packed, _ = model(idx, position_ids=pos, doc_ids=doc)
        start = 0
        for d in docs:
            alone, _ = model(d[None])
            # fp32, different kernels (masked vs is_causal SDPA): agree to 1e-5 absolute.
            torch.testing.assert_close(packed[0, start:start + d.numel()], alone[0],
                                       atol=1e-5, rtol=0)
            start += d.numel()


def test_packed_without_masking_would_leak_across_documents():
    # Guards the test above: plain causal attention over the same row differs.
    model = GPT(cfg(), V, seed=0).eval()
    docs = [tokens(1, n, seed=n)[0] for n in (5, 7, 4)]
    idx, pos, doc = packed_row(docs)
    with torch.no_grad():
        masked, _ = model(idx, position_ids=pos, doc_ids=doc)
        leaky, _ = model(idx)
    assert torch.allclose(masked[0, :5], leaky[0, :5], atol=1e-6)  # the first sees only itself
    assert not torch.allclose(masked[0, 5:], leaky[0, 5:], atol=1e-3)


@pytest.mark.parametrize("mode", ["mask", "segments"])
def test_changing_one_packed_document_leaves_the_others_unchanged(mode):
    model = GPT(cfg(), V, seed=0).eval()
    model.packed_sdpa = mode
    docs = [tokens(1, n, seed=n)[0] for n in (5, 7, 4)]
    changed = [docs[0], (docs[1] + 1) % V, docs[2]]
    with torch.no_grad():
        a, _ = model(packed_row(docs)[0], position_ids=packed_row(docs)[1],
                     doc_ids=packed_row(docs)[2])
        b, _ = model(packed_row(changed)[0], position_ids=packed_row(changed)[1],
                     doc_ids=packed_row(changed)[2])
    assert torch.allclose(a[0, :5], b[0, :5], atol=1e-6, rtol=0)
    assert torch.allclose(a[0, 12:], b[0, 12:], atol=1e-6, rtol=0)
    assert not torch.allclose(a[0, 5:12], b[0, 5:12], atol=1e-3)


def test_ignored_targets_carry_no_loss():
    model = GPT(cfg(), V, seed=0)
    x, y = tokens(), tokens(seed=1)
    half = y.clone()
    half[:, 8:] = IGNORE
    _, full_loss = model(x, y)
    _, half_loss = model(x, half)
    logits, _ = model(x)
    expected = torch.nn.functional.cross_entropy(logits[:, :8].reshape(-1, V), y[:, :8].reshape(-1))
    torch.testing.assert_close(half_loss, expected)
    assert not torch.allclose(half_loss, full_loss)


def test_cu_seqlens_split_rows_and_document_changes_for_flash_varlen():
    doc = torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]])
    cu, max_len = cu_seqlens(doc)
    assert cu.tolist() == [0, 2, 5, 8, 10] and max_len == 3
    same_id_across_rows = torch.tensor([[0, 0, 0], [0, 0, 0]])
    assert cu_seqlens(same_id_across_rows)[0].tolist() == [0, 3, 6]


def test_block_causal_mask_allows_only_earlier_tokens_of_the_same_document():
    mask = block_causal_mask(torch.tensor([[0, 0, 1]]))[0, 0]
    assert mask.tolist() == [[True, False, False], [True, True, False], [False, False, True]]


def test_packed_modes_agree_and_gradients_match():
    docs = [tokens(1, n, seed=n)[0] for n in (5, 7, 4)]
    idx, pos, doc = packed_row(docs)
    grads = {}
    for mode in ("mask", "segments"):
        model = GPT(cfg(), V, seed=0)
        model.packed_sdpa = mode
        _, loss = model(idx, (idx + 1) % V, position_ids=pos, doc_ids=doc)
        loss.backward()
        grads[mode] = (loss.detach(), [p.grad for p in model.parameters()])
    torch.testing.assert_close(grads["mask"][0], grads["segments"][0], atol=1e-6, rtol=0)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads["mask"][1],
                                                             grads["segments"][1]))


def test_packed_attention_mode_prefers_flash_then_segments_on_cpu_then_mask():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert packed_mode("flash", torch.bfloat16, gpu, "auto") == "flash_varlen"
    assert packed_mode("flash", torch.float32, gpu, "auto") == "mask"  # flash needs fp16/bf16
    assert packed_mode("sdpa", torch.float32, cpu, "auto") == "segments"
    assert packed_mode("sdpa", torch.float32, cpu, "mask") == "mask"


def test_activation_checkpointing_keeps_packed_rows_exact():
    docs = [tokens(1, n, seed=n)[0] for n in (5, 7, 4)]
    idx, pos, doc = packed_row(docs)
    out = []
    for ckpt in (False, True):
        model = GPT(cfg(activation_checkpointing=ckpt), V, seed=0)
        _, loss = model(idx, (idx + 1) % V, position_ids=pos, doc_ids=doc)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out[0][1], out[1][1]))


@pytest.mark.process
def test_compiled_blocks_match_eager_under_its_names_and_take_any_packed_row_in_one_graph():
    """model.compile: the blocks compiled in place (a checkpoint saved either way loads in
    the other), numbers as eager, one graph for every block; per-document attention stays
    eager inside it and the segment count is a dynamic size, so packed rows of other
    document lengths and counts reuse that graph (tracing the attention, or guarding on the
    count, would recompile on every step)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled, eager = GPT(cfg(compile=True, n_layers=3), V, seed=0), GPT(cfg(n_layers=3), V, seed=0)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    x, y = tokens(), tokens(seed=1)
    losses = []
    for model in (eager, compiled):
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[1], losses[0], atol=1e-5)
    grads = dict(eager.named_parameters())
    assert all(torch.allclose(p.grad, grads[n].grad, atol=1e-5)
               for n, p in compiled.named_parameters())
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    graphs = []
    for lengths in ((5, 7, 4), (9, 3, 4), (2, 2, 12), (16,), (1, 3, 5, 7)):
        idx, pos, doc = packed_row([tokens(1, n, seed=n)[0] for n in lengths])
        _, loss = compiled(idx, (idx + 1) % V, position_ids=pos, doc_ids=doc)
        _, want = eager(idx, (idx + 1) % V, position_ids=pos, doc_ids=doc)
        assert torch.allclose(loss, want, atol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1], graphs
