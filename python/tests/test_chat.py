"""treeattn.from_chat: chat-log rollouts to token rollouts (issue 38).

A word-level tokenizer with a Qwen3-style template (reasoning of assistant
messages before the last user message is dropped) stands in for a real
model's; every expectation is checked against the tokenizer's own
``apply_chat_template``."""

import pytest
import torch

import treeattn

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
           "<tool_response>", "</tool_response>", "<｜Assistant｜>"]
WORDS = ("system tools user assistant tool you are helpful what is the weather in paris rome search sunny rainy "
         "20 degrees it let me check answer and tomorrow thanks").split()

# Qwen3's rule, in a small template: an assistant message keeps its
# reasoning only after the last user message; tool results are user turns
# wrapped in <tool_response>.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}<|im_start|>system tools {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|im_start|>assistant\n"
    "{%- if m.reasoning_content and loop.index0 > ns.last_user %}<think> {{ m.reasoning_content }} </think> "
    "{% endif %} {{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %} <tool_call> {{ tc.function.name }} {{ tc.function.arguments.query }}"
    " </tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' -%}<|im_start|>user\n<tool_response> {{ m.content }} </tool_response><|im_end|>\n"
    "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)

# DeepSeek-R1's shape: the generation prompt prefills <think>, rendered
# assistant messages carry no reasoning, so the prompt is no prefix of the
# conversation rendered with the answer.
R1_LIKE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<｜Assistant｜>{{ m.content }}<|im_end|>"
    "{%- else -%}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<｜Assistant｜><think>{%- endif -%}"
)


def tokenizer(template=QWEN3_LIKE):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>"] + SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=SPECIAL)
    t.chat_template = template
    return t


TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {}}}]


def search(q):
    return {"name": "search", "arguments": {"query": q}}


def conversation():
    """One rollout's chat log: a tool call, its answer, then a second user
    turn (where the template drops the first turn's reasoning)."""
    u1 = {"role": "user", "content": "what is the weather in paris"}
    a0 = {"role": "assistant", "reasoning_content": "let me check", "content": "",
          "tool_calls": [{"type": "function", "function": search("paris")}]}
    t0 = {"role": "tool", "content": "sunny 20 degrees"}
    a1 = {"role": "assistant", "reasoning_content": "it is sunny", "content": "sunny and 20 degrees"}
    u2 = {"role": "user", "content": "and rome tomorrow"}
    a2 = {"role": "assistant", "reasoning_content": "let me check rome", "content": "",
          "tool_calls": [{"type": "function", "function": search("rome")}]}
    return {
        "id": "r0", "reward": 1.0, "group": "q0",
        "calls": [
            {"messages": [u1], "tools": TOOLS, "completion": a0},
            {"messages": [u1, a0, t0], "tools": TOOLS, "completion": a1},
            {"messages": [u1, a0, t0, a1, u2], "tools": TOOLS, "completion": a2, "summary": False},
        ],
    }


def test_contexts_are_the_templates_ids_and_completions_its_render_after_the_prompt():
    tok = tokenizer()
    rec = conversation()
    out = treeattn.from_chat([rec], tok)
    (r,) = out
    assert isinstance(out, list) and r["id"] == "r0" and r["reward"] == 1.0 and r["group"] == "q0"
    for call, tc in zip(rec["calls"], r["calls"]):
        ctx = tok.apply_chat_template(call["messages"], tools=TOOLS, add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        assert tc["context"] == list(ctx)
        # The message rendered after the prompt: the next render's tokens.
        full = tok.apply_chat_template(call["messages"] + [call["completion"]], tools=TOOLS,
                                       tokenize=True, return_dict=False)
        assert tc["context"] + tc["completion"] == list(full)
    # The first two calls extend (the tool turn keeps the reasoning); the
    # third drops call 0's and 1's reasoning: a junction the template made.
    assert r["calls"][1]["context"][: len(r["calls"][0]["context"]) + len(r["calls"][0]["completion"])] == \
        r["calls"][0]["context"] + r["calls"][0]["completion"]
    rep = out.report
    assert rep.calls == 3 and rep.retokenized_calls == 3
    assert rep.retokenized_contexts == 3 and rep.retokenized_completions == 3
    (s,) = rep.rollouts
    assert (s["calls"], s["junctions"], s["template_junctions"]) == (3, 1, 1)
    assert s["tokens"] == sum(len(c["context"]) + len(c["completion"]) for c in r["calls"])
    (p,) = treeattn.pack(list(out), share_prefixes=False)
    assert s["packed_tokens"] == len(p) < s["tokens"]
    assert p.stats[0]["junctions"] == 1
    assert "summary" in r["calls"][2] and r["calls"][2]["summary"] is False


def test_the_reasoning_is_in_the_completion_and_dropped_later():
    tok = tokenizer()
    (r,) = treeattn.from_chat([conversation()], tok)
    think = tok.convert_tokens_to_ids("<think>")
    assert think in r["calls"][0]["completion"] and think in r["calls"][1]["completion"]
    # Call 2's context has no <think> left: both earlier turns lost it.
    assert think not in r["calls"][2]["context"]


def test_an_edit_of_the_messages_is_a_junction_of_the_harness_not_of_the_template():
    tok = tokenizer()
    rec = conversation()
    u1, a0, t0, a1, u2 = rec["calls"][2]["messages"]
    # The harness evicts the tool result: the messages no longer extend.
    rec["calls"][2]["messages"] = [u1, a1, u2]
    out = treeattn.from_chat([rec], tok)
    s = out.report.rollouts[0]
    assert (s["junctions"], s["template_junctions"]) == (1, 0)


def test_engine_ids_are_used_exactly_and_not_counted_as_retokenized():
    tok = tokenizer()
    rec = conversation()
    ctx = tok.apply_chat_template(rec["calls"][0]["messages"], tools=TOOLS, add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    # Ids the tokenizer would never produce from the text: used as they are.
    engine_completion = [tok.convert_tokens_to_ids("sunny"), 7, 7, tok.convert_tokens_to_ids("<|im_end|>")]
    rec["calls"][0].update(prompt_token_ids=list(ctx), completion_token_ids=torch.tensor(engine_completion),
                           logprobs=[-0.5, -1.0, -0.25, -0.125])
    rec["calls"][1]["completion"] = "sunny and 20 degrees <|im_end|>"
    out = treeattn.from_chat([rec], tok)
    c0, c1 = out[0]["calls"][:2]
    assert c0["context"] == list(ctx) and c0["completion"] == engine_completion
    assert c0["logprobs"] == [-0.5, -1.0, -0.25, -0.125]
    ids = tok("sunny and 20 degrees <|im_end|>", add_special_tokens=False)["input_ids"]
    assert c1["completion"] == ids and "logprobs" not in c1
    rep = out.report
    assert rep.retokenized_calls == 2 and rep.retokenized_contexts == 2 and rep.retokenized_completions == 2
    assert rep.rollouts[0]["retokenized"] == 2
    # Only engine ids: no template needed at all.
    bare = tokenizer(None)
    assert bare.chat_template is None
    eng = {"id": "e", "calls": [{"prompt_token_ids": [1, 2], "completion_token_ids": [3]}]}
    out = treeattn.from_chat([eng], bare)
    assert out[0]["calls"] == [{"context": [1, 2], "completion": [3]}] and out.report.retokenized_calls == 0


def test_rl_fields_pass_through_and_pack_reads_them():
    tok = tokenizer()
    rec = conversation()
    n = [len(c["completion"]) for c in treeattn.from_chat([rec], tok)[0]["calls"]]
    rec.update(truncated=True, rewards=[[0.0] * k for k in n])
    rec["calls"][1]["summary"] = True
    out = treeattn.from_chat([rec, dict(conversation(), id="r1", reward=0.0)], tok)
    assert out[0]["truncated"] is True and out[0]["rewards"] == rec["rewards"]
    assert out[0]["calls"][1]["summary"] is True
    (p,) = treeattn.pack(out)
    assert p.rollout_truncated.tolist() == [True, False]
    assert p.rollout_reward.tolist() == [1.0, 0.0] and p.groups == ["q0"]
    assert bool(p.loss_summary.any())


def test_errors_name_the_rollout_and_call():
    tok = tokenizer()

    def fails(rec, match, t=tok, **kw):
        with pytest.raises(ValueError, match=match):
            treeattn.from_chat([rec], t, **kw)

    def with_call(c, **kw):
        rec = conversation()
        rec["calls"][c].update(kw)
        return rec

    fails(conversation(), r"rollout 'r0', call 0: the tokenizer has no chat template", t=tokenizer(None))
    fails(with_call(1, completion_token_ids=[3, 2], logprobs=[-1.0]),
          r"rollout 'r0', call 1: logprobs has 1 entries for 2 completion tokens")
    fails(with_call(2, logprobs=[-1.0]), r"rollout 'r0', call 2: logprobs has 1 entries .*tokenized here")
    fails(with_call(1, completion_token_ids=[3, 10_000]),
          r"rollout 'r0', call 1: completion_token_ids\[1\] = 10000 is not in the tokenizer's vocabulary")
    fails(with_call(0, prompt_token_ids=[1, -1]), r"call 0: prompt_token_ids\[1\] = -1 is not in")
    fails(with_call(0, prompt_token_ids=[1, 2.0]), r"call 0: prompt_token_ids\[1\] = 2.0 is not an int")
    fails(with_call(0, prompt_token_ids=[True]), r"call 0: prompt_token_ids\[0\] = True is not an int")
    fails(with_call(1, completion_token_ids=[3], logprobs=[0.5]), r"call 1: logprobs\[0\] = 0.5 is not a log-prob")
    fails(with_call(1, completion_token_ids=[3], logprobs=[float("nan")]), r"call 1: logprobs\[0\] = nan")
    fails(with_call(1, completion=None), r"rollout 'r0', call 1: \"completion\" must be")
    fails(with_call(1, completion=""), r"rollout 'r0', call 1: the completion is empty")
    fails(with_call(1, messages=None), r"rollout 'r0', call 1: a call needs \"messages\"")
    fails(dict(conversation(), rewards=[[0.0]] * 3), r"rollout 'r0', call 0: rewards\[0\] has 1 entries")
    fails({"id": "x", "calls": []}, r"rollout 'x': \"calls\" must be a non-empty list")
    fails({"calls": [{}]}, r"records\[0\]: a record needs a non-empty \"id\"")
    # A template that raises while rendering, named.
    bad = tokenizer("{{ raise_exception('no tools here') }}")
    fails(conversation(), r"rollout 'r0', call 0: the chat template does not render .*no tools here", t=bad)
    # An assistant message the template cannot render after its prompt.
    r1 = tokenizer(R1_LIKE)
    rec = {"id": "d", "calls": [{"messages": [{"role": "user", "content": "what is it"}],
                                 "completion": {"role": "assistant", "content": "sunny"}}]}
    fails(rec, r"rollout 'd', call 0: the chat template cannot render this assistant message after its prompt",
          t=r1)
    # ... while the sampled text of the same call is fine.
    rec["calls"][0]["completion"] = "sunny </think> sunny"
    (r,) = treeattn.from_chat([rec], r1)
    assert r["calls"][0]["context"][-1] == r1.convert_tokens_to_ids("<think>")
    with pytest.raises(ValueError, match=r"rollout 'r0': the id is used by an earlier record"):
        treeattn.from_chat([conversation(), conversation()], tok)


def test_tools_of_the_record_are_the_calls_default():
    tok = tokenizer()
    rec = conversation()
    for c in rec["calls"]:
        del c["tools"]
    bare = treeattn.from_chat([rec], tok)
    rec["tools"] = TOOLS
    out = treeattn.from_chat([rec], tok)
    ref = treeattn.from_chat([conversation()], tok)
    assert [c["context"] for c in out[0]["calls"]] == [c["context"] for c in ref[0]["calls"]]
    assert len(bare[0]["calls"][0]["context"]) < len(out[0]["calls"][0]["context"])  # no tools: no system turn


def test_template_kwargs_and_a_template_of_the_callers_own():
    tok = tokenizer(None)
    flag = "{% if shout %}answer {% endif %}{% for m in messages %}{{ m.content }} {% endfor %}"
    rec = {"id": "k", "calls": [{"messages": [{"role": "user", "content": "what is it"}], "completion": "sunny"}]}
    a = treeattn.from_chat([rec], tok, chat_template=flag)
    b = treeattn.from_chat([rec], tok, chat_template=flag, template_kwargs={"shout": True})
    assert b[0]["calls"][0]["context"] == [tok.convert_tokens_to_ids("answer")] + a[0]["calls"][0]["context"]
    with pytest.raises(ValueError, match="template_kwargs may not set 'tools'"):
        treeattn.from_chat([rec], tok, chat_template=flag, template_kwargs={"tools": []})
