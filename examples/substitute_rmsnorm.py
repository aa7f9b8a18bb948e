"""Substitution in a Hugging Face model: every LlamaRMSNorm runs your own kernel.

A `T.Module` rule is a lookaside: while tracing, each call of a matching module runs
`impl(module, *args)` instead of its `forward`, and `impl` reads the module's parameters. Here
`impl` calls a custom op (`torch.library.custom_op` with a fake implementation for tracing); a
Triton or CUDA kernel registered the same way goes in the same place. The model code is unchanged.

    python examples/substitute_rmsnorm.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import dynaflow_fn as df
from dynaflow_fn import transforms as T


@torch.library.custom_op("examples::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, as LlamaRMSNorm computes it: stands in for a fused kernel of your own."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4)
    model = LlamaForCausalLM(config).to(device).eval()
    fn, params = df.pure(model)

    def logits(params, ids):
        return fn(params, ids, use_cache=False).logits

    fused = T.substitute(logits, {T.Module(LlamaRMSNorm): lambda norm, x: rms_norm(x, norm.weight,
                                                                                   norm.variance_epsilon)})
    ids = torch.randint(0, config.vocab_size, (2, 32), device=device)
    program = df.trace(fused, params, ids)
    print("\n".join(line for line in str(program).splitlines() if "rms_norm" in line))
    with torch.no_grad():
        difference = (df.jit(fused)(params, ids) - model(ids).logits).abs().max().item()
    print(f"{sum(isinstance(m, LlamaRMSNorm) for m in model.modules())} RMSNorm modules substituted; "
          f"largest difference from the model: {difference:.3g}")


if __name__ == "__main__":
    main()
