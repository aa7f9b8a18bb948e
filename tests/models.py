"""Small models shared by the tests. Each builds with random weights; nothing is downloaded."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dynaflow_fn as df


class MLP(nn.Module):
    def __init__(self, sizes=(32, 64, 64, 16)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class ConvNet(nn.Module):
    def __init__(self, channels=3, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """A pre-norm transformer block with a region-tagged attention."""

    def __init__(self, dim=32, heads=4, hidden=64):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        with df.region("attn"):
            x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DropoutNet(nn.Module):
    """Linear -> batch norm -> dropout: its output depends on train/eval mode twice over."""

    def __init__(self, dim=32):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.bn(self.fc(x)))


class TwoBranch(nn.Module):
    """Two independent branches joined at the end: the shape `branches` overlaps."""

    def __init__(self, dim=32):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, dim))
        self.right = nn.Sequential(nn.Linear(dim, 48), nn.Tanh(), nn.Linear(48, dim))

    def forward(self, x, y):
        return self.left(x) + self.right(y)


def guided_denoiser(take_apart: str = "chunk"):
    """Classifier-free guidance over a small MLP (inputs of 8 features): the unconditional and the
    conditional rows of each sample run as one batch of twice the rows, are taken apart again
    (`take_apart`: "chunk", "split" or "slice") and mixed row by row."""
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).eval()

    def guided(x, cond):
        eps = net(torch.cat([x, x]) + torch.cat([torch.zeros_like(cond), cond]))
        b = x.shape[0]
        unconditional, conditional = {"chunk": lambda: eps.chunk(2), "split": lambda: eps.split(b),
                                      "slice": lambda: (eps[:b], eps[b:])}[take_apart]()
        return unconditional + 7.5 * (conditional - unconditional)
    return guided


def tiny_llama(layers=2, vocab=128, hidden=64, tie=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


def llama_logits(model):
    """A pure function of (params, input_ids) returning the logits of an HF causal LM."""
    fn, params = df.pure(model)

    def logits(params, input_ids):
        return fn(params, input_ids, use_cache=False).logits

    return logits, params


CAUSAL_LMS = ("gpt2", "llama", "llama-left-padded", "mistral-sliding-window", "gemma2", "qwen2", "mixtral")
"""The transformers families the strategy tests run: learned and rotary positions, left padding, a
sliding window, Gemma2's soft-capping and alternating windows, Qwen2's biases, Mixtral's experts."""


def tiny_causal_lm(name: str, layers: int = 2):
    """A tiny random transformers causal LM of family `name` (one of CAUSAL_LMS), in eval mode."""
    import transformers as hf

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    builders = {
        "gpt2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=64, n_embd=32, n_layer=layers, n_head=4,
                                                         n_positions=64, bos_token_id=0, eos_token_id=0)),
        "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**common)),
        "llama-left-padded": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**common)),
        "mistral-sliding-window": lambda: hf.MistralForCausalLM(hf.MistralConfig(**common, sliding_window=4)),
        "gemma2": lambda: hf.Gemma2ForCausalLM(hf.Gemma2Config(**common, head_dim=8, sliding_window=4)),
        "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**common)),
        "mixtral": lambda: hf.MixtralForCausalLM(hf.MixtralConfig(**common, num_local_experts=4,
                                                                  num_experts_per_tok=2)),
    }
    return builders[name]().eval()


def tiny_moe(name: str):
    """A tiny random transformers mixture-of-experts LM ("mixtral", "qwen3_moe", "deepseek_v3" or "gpt_oss", whose
    experts have biases), in eval mode."""
    import transformers as hf

    configs = {
        "mixtral": (hf.MixtralConfig, hf.MixtralForCausalLM, dict(
            intermediate_size=64, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": (hf.Qwen3MoeConfig, hf.Qwen3MoeForCausalLM, dict(
            intermediate_size=64, moe_intermediate_size=32, num_key_value_heads=2, num_experts=4,
            num_experts_per_tok=2, head_dim=8)),
        "deepseek_v3": (hf.DeepseekV3Config, hf.DeepseekV3ForCausalLM, dict(
            intermediate_size=64, moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1)),
        "gpt_oss": (hf.GptOssConfig, hf.GptOssForCausalLM, dict(
            intermediate_size=32, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
            layer_types=["full_attention", "sliding_attention"])),
    }
    config, model, extra = configs[name]
    return model(config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **extra)).eval()


def causal_lm_inputs(name: str, batch: int, length: int = 10, generator=None):
    """Token ids and an attention mask for `tiny_causal_lm(name)`; left-padded rows for that family."""
    import torch

    ids = torch.randint(0, 64, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    if name == "llama-left-padded":
        mask[0, :3] = 0
        mask[-1, :1] = 0
    return ids, mask


def tag_attention_regions(model, name: str = "attn") -> None:
    """Wrap every attention module's forward in `df.region(name)`: T.Region rules for a model whose
    code we cannot edit."""
    for module_name, module in model.named_modules():
        if module_name.endswith(("self_attn", ".attn")):
            forward = module.forward

            def tagged(*args, _forward=forward, **kwargs):
                with df.region(name):
                    return _forward(*args, **kwargs)
            module.forward = tagged
