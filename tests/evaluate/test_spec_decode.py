import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from eagle3.drafter.caches import KVCache
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.settings.drafter import DrafterSettings
from eagle3.evaluate.report import acceptance_rates, summarize
from eagle3.evaluate.spec_decode import SpeculativeDecoder, greedy_generate
from eagle3.targets.capture import HiddenCapture, find_decoder_stack
from eagle3.targets.aux_layers import default_aux_layer_ids
from eagle3.vocab.mapping import build_vocab_mapping


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def target(request, tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir(request.param), dtype=torch.float32).eval()


class OracleDrafter(nn.Module):
    """Test double for Eagle3Drafter: knows the target's greedy continuation and proposes it
    correctly for the first ``right`` chain positions of every step, wrongly after that."""

    def __init__(self, continuation: list[int], vocab: int, k: int, right: int) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)
        self.continuation, self.vocab, self.k, self.right = continuation, vocab, k, right
        self.calls = 0

    def project_aux(self, aux):
        return aux[..., :4]

    def step(self, input_ids, hidden, position_ids, cache=None):
        chain_index = self.calls % self.k
        self.calls += 1
        predicted = self.continuation[int(position_ids[0, -1]) + 2]  # row t predicts token t+2
        if chain_index >= self.right:
            predicted = (predicted + 1) % self.vocab
        logits = torch.full((1, input_ids.shape[1], self.vocab), -1.0)
        logits[0, -1, predicted] = 1.0
        cache = cache if cache is not None else KVCache()
        return hidden[:, -1:], logits, cache


@pytest.mark.parametrize("right", [0, 2, 4])
def test_acceptance_is_counted_exactly_with_an_oracle_drafter(target, right):
    k, max_new = 4, 25
    prompt = torch.randint(0, 900, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = greedy_generate(target, prompt, max_new + k + 2, set())
    vocab = target.config.vocab_size
    oracle = OracleDrafter(prompt + reference, vocab, k, right)
    d2t = torch.zeros(vocab, dtype=torch.int64)  # identity draft vocab
    aux_ids = default_aux_layer_ids(target.config.num_hidden_layers)
    with HiddenCapture(find_decoder_stack(target, target.config.num_hidden_layers), aux_ids) as capture:
        result = SpeculativeDecoder(target, capture, oracle, d2t, k, set()).generate(prompt, max_new)
    assert result.tokens == reference[:max_new]
    assert result.accept_lengths == [right + 1] * result.steps
    assert result.accepted_at == [result.steps] * right + [0] * (k - right)
    assert 1 + sum(result.accept_lengths) >= max_new  # the prefill token + every step's tokens


def test_untrained_drafter_output_equals_greedy(target):
    k = 3
    aux_ids = default_aux_layer_ids(target.config.num_hidden_layers)
    counts = torch.arange(target.config.vocab_size, 0, -1)
    d2t, _ = build_vocab_mapping(counts, 300)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(target.config, DrafterSettings(), 300, aux_ids)).eval()
    drafter.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    eos = {int(target.config.eos_token_id)}
    with HiddenCapture(find_decoder_stack(target, target.config.num_hidden_layers), aux_ids) as capture:
        decoder = SpeculativeDecoder(target, capture, drafter, d2t, k, eos)
        for seed in range(2):
            prompt = torch.randint(0, 900, (7 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
            result = decoder.generate(prompt, 20)
            assert result.tokens == greedy_generate(target, prompt, 20, eos)
            assert all(1 <= a <= k + 1 for a in result.accept_lengths)
            assert sum(result.accepted_at) == sum(result.accept_lengths) - result.steps


def test_acceptance_rates_conditional_and_cumulative():
    rates = acceptance_rates([8, 4, 1], steps=10)
    assert rates["cumulative"] == [0.8, 0.4, 0.1]
    assert rates["conditional"] == [0.8, 0.5, 0.25]
    report = summarize(3, [1, 2, 4, 3], [3, 2, 1], tokens_generated=11)
    assert report["mean_acceptance_length"] == 2.5 and report["draft_tokens_accepted"] == 6
    assert report["draft_tokens_proposed"] == 12 and report["acceptance_length_histogram"] == {"1": 1, "2": 1, "3": 1, "4": 1}
