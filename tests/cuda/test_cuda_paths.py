"""The CUDA-only paths, for a GPU machine (skipped elsewhere): compiled training against eager,
batched decoding against one-at-a-time, and the train stage end to end with compilation on.

On a GPU machine: ``python -m pytest -q tests/cuda``.
On CPU the same bodies pass with the device swapped (inductor compiles for CPU too).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle3.drafter.linear_kl import _compiled_chunk_kl, chunk_kl, linear_kl
from eagle3.drafter.loss import TTTObjective
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from tests.committed import key_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tests/cuda runs on the GPU machine)")]

CUDA = torch.device("cuda")
SHAPE = dict(hidden_size=256, target_hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, vocab_size=2000, draft_vocab_size=512, aux_layer_ids=[1, 2, 3])


def batch(b: int = 2, t: int = 384, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SHAPE["vocab_size"], (b, t), generator=g)
    aux = torch.randn(b, t, 3 * SHAPE["target_hidden_size"], generator=g)
    final = torch.randn(b, t, SHAPE["target_hidden_size"], generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.5).to(torch.uint8)
    return [x.to(CUDA) for x in (ids, aux.bfloat16(), final.bfloat16(), mask)]


def objective(compiled: bool, attention: str = "flex") -> TTTObjective:
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig(**SHAPE))
    obj = TTTObjective(drafter, 4, 0.8, chunk_rows=256, attention=attention, compiled=compiled).to(CUDA)
    drafter.embed_tokens.weight.data = drafter.embed_tokens.weight.data.bfloat16()
    obj.teacher_head = (torch.randn(SHAPE["draft_vocab_size"], SHAPE["target_hidden_size"], generator=torch.Generator().manual_seed(1))
                        * 0.05).to(CUDA, torch.bfloat16)
    return obj


def loss_and_grads(obj: TTTObjective, data, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, *_ = obj(*data, **kwargs)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in obj.named_parameters() if p.grad is not None}


def test_compiled_objective_matches_eager_and_sdpa(capfd):
    data = batch()
    ref_loss, ref_grads = loss_and_grads(objective(False, "sdpa"), data)
    for compiled, attention in ((False, "flex"), (True, "flex")):
        loss, grads = loss_and_grads(objective(compiled, attention), data)
        torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            cos = torch.nn.functional.cosine_similarity(g.flatten(), ref_grads[name].flatten(), dim=0)
            assert cos > 0.99, (compiled, attention, name, float(cos))
    assert "unavailable" not in capfd.readouterr().err  # nothing fell back to eager or SDPA


def packed_docs(bounds: list[int]) -> torch.Tensor:
    docs = torch.empty(1, bounds[-1], dtype=torch.int32)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        docs[0, a:b] = i if b < bounds[-1] else -1
    return docs.to(CUDA)


def test_packed_rows_compiled_flex_matches_dense_sdpa(capfd):
    """A packed row (document-masked TTT attention): the compiled flex kernel with the block lists
    built from document boundaries — on the CPU, as the training loop's prefetch thread makes
    them, packed into one tensor and copied over — against SDPA with the dense mask; a second row
    with other documents reuses the compiled graphs (one shape, one compile)."""
    import torch._dynamo.utils as dynamo_utils

    from eagle3.drafter.masks import pack_block_lists

    rows = ([0, 100, 300, 520, 700, 768], [0, 128, 129, 640, 768])
    compiled = objective(True, "flex")
    for i, bounds in enumerate(rows):
        data = [*batch(b=1, t=768, seed=i), packed_docs(bounds)]
        ref_loss, ref_grads = loss_and_grads(objective(False, "sdpa"), data)
        if i == 1:
            before = dynamo_utils.counters["stats"]["unique_graphs"]
        compiled.zero_grad(set_to_none=True)
        flat, layout = pack_block_lists(data[-1].cpu(), compiled.steps, pin=True)
        loss, grads = loss_and_grads(compiled, data, block_lists=(flat.to(CUDA, non_blocking=True), layout))
        torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
        for name, g in grads.items():
            cos = torch.nn.functional.cosine_similarity(g.flatten(), ref_grads[name].flatten(), dim=0)
            assert cos > 0.99, (bounds, name, float(cos))
    new_graphs = dynamo_utils.counters["stats"]["unique_graphs"] - before
    assert new_graphs == 0, f"the second packed row compiled {new_graphs} new graphs"
    assert "unavailable" not in capfd.readouterr().err


def test_compiled_kl_chunk_matches_eager_for_changing_row_counts():
    w = torch.randn(512, 256, device=CUDA, dtype=torch.bfloat16)
    for rows in (300, 17, 1024):  # dynamic row count: one compiled graph serves them all
        x = torch.randn(rows, 256, device=CUDA, dtype=torch.bfloat16)
        t = torch.randn(rows, 512, device=CUDA, dtype=torch.bfloat16) * 3
        kl, hits, g = _compiled_chunk_kl(x, w, t)
        kl_e, hits_e, g_e = chunk_kl(x, w, t)
        torch.testing.assert_close(kl, kl_e, rtol=1e-3, atol=1e-2)
        assert abs(int(hits) - int(hits_e)) <= max(1, rows // 100)
        torch.testing.assert_close(g.float(), g_e.float(), rtol=2e-2, atol=2e-3)
    assert _compiled_chunk_kl.broken is None


def test_linear_kl_gradients_on_cuda_match_autograd():
    x = torch.randn(600, 256, device=CUDA, requires_grad=True)
    w = torch.randn(512, 256, device=CUDA, requires_grad=True)
    t = torch.randn(600, 512, device=CUDA)
    kl, _ = linear_kl(x, w, t, chunk_rows=256, compiled=True)
    kl.backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logq = torch.log_softmax(xr @ wr.T, -1)
    logp = torch.log_softmax(t, -1)
    (logp.exp() * (logp - logq)).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-3, atol=1e-3)


def test_batched_decoding_equals_one_at_a_time_on_cuda(tiny_target_dir):
    from tests.evaluate.test_batched import batched_equals_one_at_a_time, drafter_trained_on_greedy, prompt

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir("llama"), dtype=torch.float32).eval()
    seen = [prompt(s, 4 + 5 * s) for s in range(5)]
    drafter, d2t = drafter_trained_on_greedy(target, seen)
    expected = batched_equals_one_at_a_time(target.to(CUDA), drafter.to(CUDA), d2t, seen + [prompt(99, 11)], 3, 24)
    assert max(a for r in expected for a in r.accept_lengths) > 1


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])  # muon: torch.optim.Muon beside the fused AdamW
def test_train_stage_on_cuda_compiles_and_learns(tmp_path, tiny_target_dir, tiny_cache_dir, capfd, optimizer):
    from safetensors.torch import save as save_safetensors
    from transformers import AutoConfig

    from eagle3.context import run_stage
    from eagle3.manifest import read_manifest
    from eagle3.store import open_store
    from eagle3.train.metrics import parse_metrics
    from tests.extract.pipeline import commit_generate, random_samples
    from tests.train.test_stage import TRAIN, UPSTREAM, pipeline_config

    vocab = AutoConfig.from_pretrained(tiny_target_dir("llama")).vocab_size
    overrides = {**UPSTREAM, **TRAIN, "train.device": "cuda", "extract.device": "cuda", "train.max_steps": 30,
                 "train.checkpoint_every": 10, "train.batch_tokens": 512, "train.max_seq_len": 64,
                 "train.optimizer": optimizer}
    cfg = pipeline_config(tmp_path / "store", tiny_cache_dir, **overrides)
    samples = random_samples(80, lo=8, hi=60)
    counts = torch.zeros(vocab, dtype=torch.int64)
    for _, ids, mask in samples:
        counts += torch.bincount(torch.tensor(ids)[torch.tensor(mask).bool()], minlength=vocab)
    commit_generate(cfg, samples, tmp_path, extra={"token_freq.safetensors": save_safetensors({"counts": counts})})
    for stage in ("vocab", "extract", "train"):
        run_stage(cfg, stage)
    store = open_store(cfg.store.uri)
    stats = read_manifest(store, "t", "train").manifest.stats
    assert stats["device"] == "cuda" and stats["peak_memory_gib"] > 0
    # the held-out chained accuracy is counted on the GPU too (step 0 has no step before it)
    assert stats["eval_chain_acc_0"] == pytest.approx(stats["eval_acc_0"]) and "eval_same_as_step0_1" in stats
    records = parse_metrics(store.get_bytes(key_of(store, 't', "train", 'metrics.jsonl')).decode())
    assert records[-1]["loss"] < records[0]["loss"]
    assert "unavailable" not in capfd.readouterr().err  # compiled halves, KL and flex all compiled


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_pipelined_extraction_equals_batch_by_batch_on_cuda(tiny_target_dir, storage):
    """Pinned async copies placed one batch behind give the same shard as waiting for each batch."""
    from eagle3.generate.tokenized import from_lists
    from eagle3.extract.batching import plan_batches, plan_shards, right_pad
    from eagle3.targets.capture import HiddenCapture, find_decoder_stack
    from eagle3.extract.run import ShardStats, extract_shard, to_storage
    from tests.extract.pipeline import random_samples

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir("llama"), dtype=torch.bfloat16).to(CUDA).eval()
    data = from_lists(random_samples(40, seed=3, lo=5, hi=90))
    plan = plan_shards(data.lengths(), 1 << 30)[0]
    stack = find_decoder_stack(model, model.config.num_hidden_layers)
    aux_ids, h = [1, 2, 3], model.config.hidden_size
    with HiddenCapture(stack, aux_ids) as capture:
        got = extract_shard(capture, data, plan, h, 256, storage, ShardStats())
        lengths = data.lengths().tolist()
        batches = list(plan_batches(lengths, 256))
        assert len(batches) > 3  # the pipeline has batches in flight
        for batch in batches:
            samples = [data.input_ids[int(data.offsets[j]) : int(data.offsets[j + 1])] for j in batch]
            ids, _ = right_pad(samples)
            aux, final = capture.run_stack(ids.to(CUDA))
            torch.cuda.synchronize()
            for row, j in enumerate(batch):
                dst, n = slice(int(data.offsets[j]), int(data.offsets[j + 1])), lengths[j]
                for g, state in enumerate([*aux, final]):
                    q, scale = to_storage(state[row, :n], storage)
                    stored = got.aux_hidden[dst, g * h : (g + 1) * h] if g < 3 else got.final_hidden[dst]
                    assert torch.equal(stored.view(torch.uint8), q.cpu().view(torch.uint8)), (j, g)
                    if scale is not None:
                        kept = got.aux_scale[dst, g : g + 1] if g < 3 else got.final_scale[dst]
                        torch.testing.assert_close(kept, scale.cpu(), rtol=1e-6, atol=0)


def test_batches_copied_ahead_on_a_side_stream_arrive_whole():
    """AheadOnDevice: each batch taken equals its host batch although its copy ran on a side
    stream while other work was queued on the compute stream."""
    from eagle3.train.data import Batch
    from eagle3.train.prefetch import AheadOnDevice

    def host(i: int) -> Batch:
        g = torch.Generator().manual_seed(i)
        t = 2048
        return Batch(torch.randint(0, 100, (8, t), generator=g).pin_memory(), torch.ones(8, t, dtype=torch.uint8).pin_memory(),
                     torch.randn(8, t, 3 * 640, generator=g).bfloat16().pin_memory(),
                     torch.randn(8, t, 640, generator=g).bfloat16().pin_memory(), tokens=i)

    ahead = AheadOnDevice((host(i) for i in range(6)), CUDA)
    busy = torch.randn(4096, 4096, device=CUDA)
    for i in range(6):
        b = ahead.take()
        for _ in range(5):  # the "step": compute-stream work while the next copy runs
            busy = torch.tanh(busy @ busy / 4096)
        want = host(i)
        assert b.tokens == i
        assert all(torch.equal(x.cpu(), y) for x, y in zip(b.tensors(), want.tensors()))
    assert ahead.take() is None
