"""A GRPO step on the chat logs of a thinking model with tool calls.

The harness logged, per model call, the chat messages it sent (with the
tools offered) and what came back: the assistant message (reasoning,
content, tool calls), once the sampled text, once the engine's token ids
and log-probs. The template is Qwen3's rule in miniature: an assistant
message keeps its reasoning only after the last user message, so at the
second user turn the first turn's reasoning vanishes from the context — a
junction the template makes, not the harness.

    chat logs --treeattn.from_chat--> token rollouts --treeattn.pack--> one pack
      --> a tiny Llama scores every target under its exact live prefix
      --> one GRPO step (group-normalised rewards, PPO clip)

It prints the from_chat report, the pack, the largest |log-prob difference|
between the packed forward and every call run alone (float rounding), the
GRPO step, and the drift of training on the final transcript instead
(Naive-Compressed), as ``treeattn demo`` prints it. The tokenizer (a
word-level ``tokenizers`` model in a ``PreTrainedTokenizerFast``) and the
template are built here; nothing is downloaded. Runs in seconds on CPU.

    python python/examples/chat_grpo.py [--group 4] [--dtype float32|float64]
"""

import argparse
import random
import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import treeattn
import treeattn.hf
import treeattn.rl as rl

SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
           "<tool_response>", "</tool_response>"]
WORDS = ("system user assistant tools search you are a helpful weather agent what is the in paris rome oslo "
         "today tomorrow and sunny rainy cloudy windy degrees 12 15 18 21 it will be let me check look up "
         "forecast says so answer first then maybe i think need to for thanks").split()

# Qwen3's chat template in miniature: the tools in a system turn, tool
# results as user turns in <tool_response>, and the reasoning of an
# assistant message rendered only after the last user message.
TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "<|im_start|>system\n{{ messages[0].content if messages[0].role == 'system' else '' }}"
    "{%- if tools %} tools {% for t in tools %}{{ t.function.name }} {% endfor %}{%- endif -%}<|im_end|>\n"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}"
    "{%- elif m.role == 'assistant' -%}<|im_start|>assistant\n"
    "{%- if m.reasoning_content and loop.index0 > ns.last_user %}<think> {{ m.reasoning_content }} </think> "
    "{% endif %} {{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %} <tool_call> {{ tc.function.name }} {{ tc.function.arguments.city }}"
    " {{ tc.function.arguments.day }} </tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' -%}<|im_start|>user\n<tool_response> {{ m.content }} </tool_response><|im_end|>\n"
    "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)

TOOLS = [{"type": "function", "function": {"name": "search", "description": "the forecast",
                                           "parameters": {"type": "object", "properties": {}}}}]


def tokenizer():
    vocab = {w: i for i, w in enumerate(["<unk>"] + SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=SPECIAL)
    t.chat_template = TEMPLATE
    return t


def chat_logs(group, rng):
    """One GRPO group: `group` rollouts answering the same question, each
    two user turns of (reasoning, tool call, tool result, answer)."""
    forecast = {"today": "sunny 21 degrees", "tomorrow": "rainy 12 degrees"}
    think = ["let me check the forecast", "i think i need to look up the weather", "first search then answer",
             "maybe look up paris", "the forecast says so", "let me check tomorrow"]
    system = {"role": "system", "content": "you are a helpful weather agent"}
    u1 = {"role": "user", "content": "what is the weather in paris today"}
    u2 = {"role": "user", "content": "and tomorrow"}
    records = []
    for g in range(group):
        msgs = [system, u1]
        calls = []
        right = 0
        for day, user in (("today", None), ("tomorrow", u2)):
            if user is not None:
                msgs = msgs + [user]
            call = {"type": "function", "function": {"name": "search", "arguments": {"city": "paris", "day": day}}}
            a0 = {"role": "assistant", "reasoning_content": rng.choice(think), "content": "", "tool_calls": [call]}
            calls.append({"messages": msgs, "tools": TOOLS, "completion": a0})
            msgs = msgs + [a0, {"role": "tool", "content": forecast[day]}]
            # Some answers read the tool result, some guess.
            said = forecast[day] if rng.random() < 0.6 else rng.choice(["cloudy 15 degrees", "windy 18 degrees"])
            right += said == forecast[day]
            a1 = {"role": "assistant", "reasoning_content": rng.choice(think), "content": f"it will be {said}"}
            calls.append({"messages": msgs, "tools": TOOLS, "completion": a1})
            msgs = msgs + [a1]
        records.append({"id": f"paris-{g}", "group": "paris", "reward": right / 2, "calls": calls})
    return records


def engine_ids(tok, record, c):
    """Call `c` of `record` as an inference engine logs it: the prompt's and
    the sampled completion's token ids and one log-prob per sampled token."""
    call = record["calls"][c]
    prompt = tok.apply_chat_template(call["messages"], tools=TOOLS, add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    full = tok.apply_chat_template(call["messages"] + [call["completion"]], tools=TOOLS, tokenize=True,
                                   return_dict=False)
    completion = list(full)[len(prompt):]
    return {"messages": call["messages"], "tools": TOOLS, "prompt_token_ids": list(prompt),
            "completion_token_ids": completion, "logprobs": [-0.5] * len(completion)}


def per_call_logprobs(model, rollouts, pack):
    """Log-prob of each loss entry of `pack`, its call run alone (sdpa)."""
    calls = [c for r in rollouts for c in r["calls"]]
    model.set_attn_implementation("sdpa")
    out = torch.empty(pack.loss_rows.numel(), dtype=torch.float64)
    with torch.no_grad():
        cache = {}
        for t, (g, o) in enumerate(zip(pack.loss_call.tolist(), pack.loss_offset.tolist())):
            if g not in cache:
                c = calls[g]
                seq = torch.tensor(c["context"] + c["completion"])[None]
                cache = {g: (len(c["context"]), torch.log_softmax(model(input_ids=seq).logits[0].double(), -1))}
            n, lp = cache[g]
            out[t] = lp[n - 1 + o, calls[g]["completion"][o]]
    model.set_attn_implementation("treeattn")
    return out


def final_transcript_drift(model, rollouts):
    """Naive-Compressed: each rollout scored causally on its final transcript
    (the last call's context + completion) alone. A target counts when it is
    on that transcript: its exact row lies on the last call's path (same
    prefix: the same number up to rounding) or it is a diverging target
    (an SDCC pair: its row on the final transcript is the pair's student
    row). Returns |Δ log-prob| per scored target and the unscored count."""
    (p,) = treeattn.pack(rollouts, share_prefixes=False)  # each rollout a contiguous range of rows
    parent = treeattn.paths(p.kv_end).parent.tolist()
    with torch.no_grad():
        exact = torch.log_softmax(model(input_ids=p.tokens[None], position_ids=p.position_ids[None],
                                        kv_end=p.kv_end, use_cache=False).logits[0].double(), -1)
    model.set_attn_implementation("sdpa")
    diffs, unscored, start = [], 0, 0
    student = dict(zip(p.sdcc_student_rows.tolist(), p.sdcc_teacher_rows.tolist()))
    rows, labels, local = p.loss_rows.tolist(), p.loss_labels.tolist(), p.loss_rollout_local().tolist()
    for i, r in enumerate(rollouts):
        end = start + p.stats[i]["trie_tokens"]
        path = [end - 1]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        path.reverse()  # the final transcript's rows, depth 0 first
        final = r["calls"][-1]["context"] + r["calls"][-1]["completion"]
        assert p.tokens[path].tolist() == final
        with torch.no_grad():
            naive = torch.log_softmax(model(input_ids=torch.tensor(final)[None]).logits[0].double(), -1)
        on_path = {row: d for d, row in enumerate(path)}
        scored = 0
        for t in (t for t in range(len(rows)) if local[t] == i):
            d = on_path.get(rows[t])
            if d is not None and d + 1 < len(final) and final[d + 1] == labels[t]:
                diffs.append(float(naive[d, labels[t]] - exact[rows[t], labels[t]]))
                scored += 1
        for d, row in enumerate(path[:-1]):
            if row in student:  # a diverging target: its token follows at depth d + 1
                diffs.append(float(naive[d, final[d + 1]] - exact[student[row], final[d + 1]]))
                scored += 1
        assert scored == p.stats[i]["present"], (scored, p.stats[i])
        unscored += p.stats[i]["targets"] - scored
        start = end
    model.set_attn_implementation("treeattn")
    return torch.tensor(diffs).abs(), unscored


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=4, help="rollouts in the GRPO group")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    tok = tokenizer()

    # 1. Chat logs in; one call as the sampled text, one with the engine's ids.
    records = chat_logs(a.group, rng)
    m = records[0]["calls"][3]["completion"]
    records[0]["calls"][3]["completion"] = f"<think> {m['reasoning_content']} </think> {m['content']} <|im_end|>"
    records[1]["calls"][1] = engine_ids(tok, records[1], 1)
    t0 = time.perf_counter()
    rollouts = treeattn.from_chat(records, tok)
    rep = rollouts.report
    print(f"from_chat: {len(records)} rollouts, {rep.calls} calls ({rep.retokenized_calls} tokenized here, "
          f"{rep.calls - rep.retokenized_calls} from engine ids), {time.perf_counter() - t0:.3f} s")
    for s in rep.rollouts:
        print(f"  {s['id']}: {s['calls']} calls, {s['junctions']} junction(s), {s['template_junctions']} made by the "
              f"template; {s['tokens']} tokens in the calls -> {s['packed_tokens']} in its trie")

    # 2. One pack (the group's shared prefix stored once).
    (pack,) = treeattn.pack(rollouts)
    print(f"pack: {len(pack)} tokens for {rep.tokens} in the calls ({sum(s['packed_tokens'] for s in rep.rollouts)} "
          f"rollout by rollout), {pack.loss_rows.numel()} targets, {pack.sdcc_student_rows.numel()} diverging")

    # 3. A tiny Llama; the packed forward against every call alone.
    treeattn.hf.register()
    torch.manual_seed(a.seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attention_dropout=0.0)
    model = LlamaForCausalLM(cfg).to(getattr(torch, a.dtype))
    model.set_attn_implementation("treeattn")
    with torch.no_grad():
        exact = treeattn.hf.target_logprobs(model, pack).double()
    worst = float((exact - per_call_logprobs(model, rollouts, pack)).abs().max())
    print(f"max |Δ log-prob| packed vs each call alone: {worst:.2e}")

    # 4. One GRPO step: group-normalised rewards, PPO clip, token-mean.
    adv = rl.grpo_advantages(pack, dtype=model.dtype)
    old = exact.to(model.dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    t0 = time.perf_counter()
    lp = treeattn.hf.target_logprobs(model, pack)
    loss, stats = rl.policy_loss(lp, old, adv, weights=pack.loss_weights)
    loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        new = treeattn.hf.target_logprobs(model, pack).double()
    up = adv > 0
    print(f"GRPO step: rewards {[r['reward'] for r in records]}, policy loss {float(loss.detach()):+.3e}, "
          f"{time.perf_counter() - t0:.2f} s; mean log-prob change of targets with advantage > 0 "
          f"{float((new - exact)[up].mean()):+.4f}, < 0 {float((new - exact)[adv < 0].mean()):+.4f}")

    # 5. What training on the final transcript instead would have scored.
    drift, unscored = final_transcript_drift(model, rollouts)
    print("  train–rollout drift of training on the final transcript instead, |Δ log-prob| against the exact "
          "log-probs:")
    print(f"    {'Naive-Compressed':<18} mean {float(drift.mean()):.4f}  max {float(drift.max()):.4f} nats over "
          f"{drift.numel()} targets ({unscored} targets not scored at all)")


if __name__ == "__main__":
    main()
