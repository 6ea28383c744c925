"""An estimate of the GPU memory each of docs/gpu.md's GPU commands needs, per process, from the model's size.

Nothing here is measured: it is arithmetic on the model's configuration (the parameters counted on the meta
device, so nothing is downloaded) that you can redo by hand, and an estimate until a GPU run measures it.

    python benchmarks/memory_estimate.py      # the table docs/gpu.md gives

Per process, in bytes (N: a model's parameters; under --fsdp each process holds 1/P of every model), each term
checked on the CPU under bfloat16 autocast, with a tiny Qwen2 loaded as load_model loads it:
- a trained model: 16 N (float32 weights 4, gradients 4, AdamW's two moments 8) plus 2 N for the bfloat16 copies
  of the weights that autocast makes in a forward pass and the backward pass keeps;
- a frozen model (reference, reward model): 4 N, held in float32 as the policy is (docs/gpu.md); under --fsdp its
  root weights (embedding, output layer, final norm: R parameters) stay gathered in bfloat16 after its no-grad
  forward pass, 2 R;
- training activations of one micro-batch of b sequences of L = prompt + completion tokens, a token and layer
  (d the hidden size, i the MLP's, h the attention heads): 34 d + 8 i + 4 h + 8 + 2 L bytes. The two RMSNorms keep
  their float32 input and output and rsqrt, 2 x (8 d + 4); q, k, v, gate and up each keep their own bfloat16 cast
  of the float32 norm output, 5 x 2 d; attention keeps q, k and v in bfloat16, the KV heads repeated (the padding
  mask makes transformers repeat them), 3 x 2 d, its float32 logsumexp, 4 h, and a bfloat16 copy of the L x L
  mask, 2 L; o_proj its input, 2 d; the MLP its gate, SiLU, up and product in bfloat16, 4 x 2 i. (Measured with
  torch.autograd.graph.saved_tensors_hooks, varying d, i, h, L and the layers.) With --gradient-checkpointing: the
  float32 layer inputs, 4 d a token and layer, plus one layer's worth;
- the output layer's backward, a chunk of C = (2^26 // vocab) x vocab x 4 bytes of float32 logits at a time
  (token_logprobs): the larger of 5 C (the recomputed logits and logsumexp's gradient) and 8 x vocab x d (each
  chunk's float32 weight gradient and its out-of-place sum into the others'); under --fsdp, where the gathered
  weight is bfloat16, the larger of 5 C and C + 10 x vocab x d (weight.float()'s copy, its float32 gradient and
  the bfloat16 one), plus the policy's root gathered in bfloat16, 2 R (measured from malloc's bytes in use);
- generation: the KV cache, 2 x layers x kv_heads x head_dim x L' x 2 bytes a row (keys and values in the compute
  dtype, bfloat16: generate()'s RolloutCache). On one process the compiled step keeps one cache on the model, for
  the largest rollout seen: its rows the larger of the rollout batch and an evaluation batch (128 prompts), L' the
  prompt and the completion each rounded up to 64; under --fsdp (no compiled step) the rollout batch's own cache,
  L' = L. Plus the float32 logits and probabilities of one position, 2 x vocab x 4 bytes a sequence, and under
  --fsdp the whole model gathered in bfloat16, 2 N (a rollout gathers each layer once and keeps it until its end).
- the compiled step's bfloat16 copy of the decoder's linear layers (rollout_weights), kept on the model: 2 D,
  static; with --lora-r only the adapters are copied (the base layers are held in bfloat16 already), 2 A.
With --lora-r R (docs/training.md): the policy's weights are frozen, 4 N, but for its decoder's linear layers (D
parameters), which are held in the compute dtype, 2 D; its adapters (A: R x (in + out) for each linear layer of the
decoder) are trained, 16 A; no reference model is held (it is the policy with its adapters off);
the training pass is counted as without LoRA, an upper bound: on three tiny Qwen2 configurations under bfloat16
autocast, the saved tensors a token and layer were fewer with LoRA on every linear layer than without.
The peak is the static part plus the larger of the training and the generation part. Not counted: the CUDA
context and the allocator's fragmentation (often 1-3 GiB more: the last column keeps 3 GiB free), NCCL's buffers.
"""

import functools
import json
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

# the published configurations of Qwen2.5-0.5B(-Instruct) and Qwen2.5-7B-Instruct
QWEN_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)
QWEN_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
GB = 2**30


@dataclass
class Command:
    name: str  # the docs/gpu.md command, shortly
    model: dict  # its configuration
    trained: int  # models trained (the policy; PPO also its value model)
    frozen: int  # models held frozen (reference, reward model)
    micro_batch: int  # sequences per forward/backward pass
    prompt: int  # tokens of a prompt, chat template included (GSM8K: about 200; a file: --max-prompt-length)
    completion: int  # tokens of a completion (--max-new-tokens; a file of pairs: --max-length - the prompt)
    rollout: int = 0  # sequences generated at once per process (prompts-per-step x group-size / processes)
    checkpointing: bool = False  # --gradient-checkpointing
    processes: int = 1  # FSDP shards every model over this many processes
    logprobs: bool = True  # the training pass goes through the output layer (not reward_model.py's score head)
    lora: int = 0  # --lora-r: the rank of the adapters on every linear layer of the decoder (0: every weight trained)


def parameters(config):
    return meta_model_counts(json.dumps(config, sort_keys=True))[0]


def decoder_linear_parameters(config):
    """D: the weights and biases of the decoder layers' linear layers (q, k, v, o, gate, up, down)."""
    return meta_model_counts(json.dumps(config, sort_keys=True))[1]


@functools.cache
def meta_model_counts(config_json):
    """(all parameters, D) of the model of a config, built once on the meta device (no memory, a fifth of a second)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**json.loads(config_json)))
    decoder_linear = (p.numel() for name, p in model.named_parameters() if name.endswith(("proj.weight", "proj.bias")))
    return sum(p.numel() for p in model.parameters()), sum(decoder_linear)


def root_parameters(config):
    """R: the parameters outside the decoder layers (embedding, output layer unless tied, final norm)."""
    d, vocab = config["hidden_size"], config["vocab_size"]
    return vocab * d * (1 if config["tie_word_embeddings"] else 2) + d


def adapter_parameters(config, rank):
    """A: rank x (inputs + outputs) of q, k, v, o, gate, up and down in every decoder layer."""
    d, i, kv = config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]
    kv_width = kv * d // config["num_attention_heads"]
    return rank * config["num_hidden_layers"] * (2 * d + 2 * (d + kv_width) + 2 * d + 3 * (d + i))


def estimate(c):
    """(static, training, generation, peak) in GiB per process."""
    n, d, i = parameters(c.model), c.model["hidden_size"], c.model["intermediate_size"]
    layers, length = c.model["num_hidden_layers"], c.prompt + c.completion
    shard, fsdp, root, vocab = c.processes, c.processes > 1, root_parameters(c.model), c.model["vocab_size"]
    static = (c.trained * 16 * n + c.frozen * 4 * n) / shard + (c.frozen * 2 * root if fsdp else 0)
    if c.lora:  # the policy frozen (its decoder's linear layers in bfloat16), its adapters trained
        static += 4 * n - 2 * decoder_linear_parameters(c.model) + 16 * adapter_parameters(c.model, c.lora) - 16 * n
    if c.rollout and not fsdp:  # the compiled step's bfloat16 copy of the weights it reads (only LoRA's adapters)
        static += 2 * (adapter_parameters(c.model, c.lora) if c.lora else decoder_linear_parameters(c.model))
    heads, chunk = c.model["num_attention_heads"], 2**26 // vocab * vocab * 4  # C: a chunk's float32 logits
    tokens, per_layer = c.micro_batch * length, 34 * d + 8 * i + 4 * heads + 8 + 2 * length  # bytes a token and layer
    if c.checkpointing:
        activations = tokens * (layers * 4 * d + per_layer)
    else:
        activations = tokens * layers * per_layer
    if fsdp:
        output_layer = max(5 * chunk, chunk + 10 * vocab * d) + 2 * root
    else:
        output_layer = max(5 * chunk, 8 * vocab * d)
    training = c.trained * 2 * n / shard + activations + (output_layer if c.logprobs else 0)
    head_dim, rows, cache_length = d // heads, c.rollout, length
    if not fsdp:  # the compiled step's one cache: an evaluation batch's rows at least, lengths in multiples of 64
        rows, cache_length = max(c.rollout, 128), -(-c.prompt // 64) * 64 + -(-c.completion // 64) * 64
    generation = (rows * 2 * layers * c.model["num_key_value_heads"] * head_dim * cache_length * 2) if c.rollout else 0
    generation += c.rollout * 2 * vocab * 4 + (2 * n if fsdp else 0)
    return static / GB, training / GB, generation / GB, (static + max(training, generation)) / GB


COMMANDS = [
    Command(
        "grpo.py, Qwen2.5-0.5B-Instruct, GSM8K",
        QWEN_05B,
        trained=1,
        frozen=1,
        micro_batch=8,
        prompt=200,
        completion=512,
        rollout=16 * 8,
        checkpointing=True,
    ),
    Command(
        "grpo.py, Qwen2.5-0.5B-Instruct, my_problems.jsonl",
        QWEN_05B,
        trained=1,
        frozen=1,
        micro_batch=8,
        prompt=512,
        completion=512,
        rollout=32 * 8,
    ),
    Command(
        "ppo.py, Qwen2.5-0.5B-Instruct, GSM8K",
        QWEN_05B,
        trained=2,
        frozen=1,
        micro_batch=8,
        prompt=200,
        completion=512,
        rollout=64,
        checkpointing=True,
    ),
    Command(
        "reward_model.py, Qwen2.5-0.5B-Instruct, my_pairs.jsonl",
        QWEN_05B,
        trained=1,
        frozen=0,
        micro_batch=2 * 4,
        prompt=512,
        completion=512,
        checkpointing=True,
        logprobs=False,
    ),
    Command(
        "dpo.py, Qwen2.5-0.5B-Instruct, my_pairs.jsonl",
        QWEN_05B,
        trained=1,
        frozen=1,
        micro_batch=2 * 4,
        prompt=512,
        completion=512,
        checkpointing=True,
    ),
    Command(
        "sft.py, Qwen2.5-0.5B, my_sft_data.jsonl",
        QWEN_05B,
        trained=1,
        frozen=0,
        micro_batch=4,
        prompt=512,
        completion=512,
    ),
    Command(
        "grpo.py --lora-r 16, Qwen2.5-0.5B-Instruct, GSM8K",
        QWEN_05B,
        trained=1,
        frozen=0,
        micro_batch=8,
        prompt=200,
        completion=512,
        rollout=16 * 8,
        checkpointing=True,
        lora=16,
    ),
    Command(
        "dpo.py --lora-r 16, Qwen2.5-0.5B-Instruct, my_pairs.jsonl",
        QWEN_05B,
        trained=1,
        frozen=0,
        micro_batch=2 * 4,
        prompt=512,
        completion=512,
        checkpointing=True,
        lora=16,
    ),
    Command(
        "grpo.py --lora-r 16, Qwen2.5-7B-Instruct, GSM8K",
        QWEN_7B,
        trained=1,
        frozen=0,
        micro_batch=4,
        prompt=200,
        completion=512,
        rollout=16 * 8,
        checkpointing=True,
        lora=16,
    ),
    Command(
        "torchrun 8 x grpo.py --fsdp, Qwen2.5-7B-Instruct, GSM8K",
        QWEN_7B,
        trained=1,
        frozen=1,
        micro_batch=4,
        prompt=200,
        completion=512,
        rollout=64 * 8 // 8,
        checkpointing=True,
        processes=8,
    ),
]


def table():
    lines = [
        "| command | parameters | weights, gradients, AdamW, frozen models (GiB) | training pass (GiB) |"
        " generation (GiB) | estimated peak per GPU (GiB) | fits on |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in COMMANDS:
        static, training, generation, peak = estimate(c)
        fits = next(
            (f"{'an' if card == 80 else 'a'} {card} GB GPU" for card in (24, 40, 80) if peak + 3 <= card),
            "no single GPU of 80 GB",
        )
        lines.append(
            f"| {c.name} | {parameters(c.model) / 1e9:.2f} B | {static:.1f} | {training:.1f} |"
            f" {generation:.1f} | {peak:.1f} | {fits} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
