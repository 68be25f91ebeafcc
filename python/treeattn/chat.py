"""Chat-log rollouts in, token rollouts out: :func:`from_chat`.

Harnesses log what they sent to the model — a list of chat messages, the
tools offered — and what came back — the sampled text or the parsed
assistant message, and, from an inference engine, the token ids and
log-probs. :func:`from_chat` turns such records into the calls format
:func:`treeattn.pack` takes (DESIGN §2), one token rollout per record::

    import treeattn
    rollouts = treeattn.from_chat(records, tokenizer)
    print(rollouts.report.retokenized_calls, rollouts.report.rollouts[0])
    packs = treeattn.pack(rollouts)

A record::

    {"id": "r0", "reward": 1.0?, "group": "q7"?, "rewards": [[...], ...]?, "truncated": bool?,
     "tools": [...]?,     # the default of the calls' "tools"
     "calls": [{"messages": [...], "tools": [...]?,
                "completion": "<sampled text>" | {"role": "assistant", ...},
                "prompt_token_ids": [...]?, "completion_token_ids": [...]?,
                "logprobs": [...]?, "summary": bool?}]}

Token ids from the engine, where given, are used exactly as they are: a
call's ``prompt_token_ids`` is its context and ``completion_token_ids`` its
completion, never re-tokenized (the engine's ids are what was sampled;
re-tokenizing the text can give other ids and then other targets).
Otherwise:

- the context is ``tokenizer.apply_chat_template(messages, tools=tools,
  add_generation_prompt=True)`` (token ids);
- a text completion is the tokenizer's ids of the text
  (``add_special_tokens=False``, as sampled: include the stop string, e.g.
  ``<|im_end|>``, in the text if the model is to learn to stop — engines
  usually strip it from the text and keep it in the ids);
- an assistant-message completion is the message as the template renders
  it after the generation prompt: the conversation with the message
  appended, rendered without a generation prompt, minus the prompt's
  render. A template whose prompt render is not a prefix of that render
  (DeepSeek-R1's, which prefills ``<think>`` in the generation prompt but
  drops reasoning from rendered messages) cannot say what was sampled, and
  the call is refused.

The report (:class:`ChatReport`, ``rollouts.report``) counts the calls
whose ids were made here (re-tokenized) and gives per rollout the calls,
the junctions (calls whose context does not extend the previous call's
context + completion), how many of them the template made (the messages
did extend: the previous call's messages plus one assistant message, yet
the tokens do not — Qwen3-style templates drop the reasoning of earlier
turns), and the tokens before (every call's context + completion) and
after packing (the rollout's trie).

Errors are ``ValueError`` naming the rollout and call.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["from_chat", "ChatRollouts", "ChatReport"]

# Rollout and call fields passed through to the calls format (src/rollout.rs).
_ROLLOUT_FIELDS = ("reward", "group", "rewards", "truncated")
_CALL_FIELDS = ("summary",)


@dataclass
class ChatReport:
    """What :func:`from_chat` did.

    ``calls``: calls in all. ``retokenized_calls``: calls with a context or
    a completion made here from messages or text (the rest came with the
    engine's ids); ``retokenized_contexts`` and ``retokenized_completions``
    count the two parts. ``rollouts``: one dict per record, in input order:
    ``id``, ``calls``, ``retokenized`` (its calls made here), ``junctions``
    (calls whose context does not extend the previous call's context +
    completion), ``template_junctions`` (those whose messages did extend the
    previous call's messages by one assistant message: the template, not
    the harness, changed the tokens), ``tokens`` (Σ context + completion
    over its calls) and ``packed_tokens`` (its trie pack's length, from
    :func:`treeattn.pack`; ``None`` with ``report=False``)."""

    calls: int = 0
    retokenized_calls: int = 0
    retokenized_contexts: int = 0
    retokenized_completions: int = 0
    rollouts: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def junctions(self) -> int:
        """Junctions over all rollouts."""
        return sum(r["junctions"] for r in self.rollouts)

    @property
    def template_junctions(self) -> int:
        """Junctions the template made, over all rollouts."""
        return sum(r["template_junctions"] for r in self.rollouts)

    @property
    def tokens(self) -> int:
        """Σ context + completion over every call."""
        return sum(r["tokens"] for r in self.rollouts)

    @property
    def packed_tokens(self) -> Optional[int]:
        """Σ of the rollouts' trie pack lengths (``None`` if not computed)."""
        if any(r["packed_tokens"] is None for r in self.rollouts):
            return None
        return sum(r["packed_tokens"] for r in self.rollouts)


class ChatRollouts(list):
    """The token rollouts (a ``list`` of dicts in the calls format, which
    :func:`treeattn.pack` takes as it is) with the :class:`ChatReport` of
    their making as ``.report``."""

    report: ChatReport

    def __init__(self, rollouts: Sequence[Dict[str, Any]], report: ChatReport) -> None:
        super().__init__(rollouts)
        self.report = report


class _Where:
    """Names a rollout and call in error messages."""

    def __init__(self, index: int, rid: Any) -> None:
        self.index, self.rid = index, rid

    def __call__(self, call: Optional[int] = None) -> str:
        who = f"records[{self.index}]" if self.rid is None else f"rollout {self.rid!r}"
        return f"from_chat: {who}" + ("" if call is None else f", call {call}")


def _ids(where: str, name: str, ids: Any, vocab: int) -> List[int]:
    """Engine token ids as a list of ints, each in ``0 .. vocab − 1``."""
    if hasattr(ids, "tolist") and not isinstance(ids, (str, bytes)):
        ids = ids.tolist()  # a tensor or array of the engine's
    if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Sequence):
        raise ValueError(f"{where}: {name} must be a list of token ids, got {type(ids).__name__}")
    out = []
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{where}: {name}[{j}] = {t!r} is not an int token id")
        t = int(t)
        if not 0 <= t < vocab:
            raise ValueError(
                f"{where}: {name}[{j}] = {t} is not in the tokenizer's vocabulary (ids 0 .. {vocab - 1})"
            )
        out.append(t)
    return out


def _logprobs(where: str, lp: Any, n: int, made_here: bool) -> List[float]:
    if hasattr(lp, "tolist") and not isinstance(lp, (str, bytes)):
        lp = lp.tolist()
    if isinstance(lp, (str, bytes, dict)) or not isinstance(lp, Sequence):
        raise ValueError(f"{where}: logprobs must be a list of numbers, got {type(lp).__name__}")
    if len(lp) != n:
        why = (
            " (the completion was tokenized here from its text or message; pass the engine's "
            "completion_token_ids with its logprobs)"
            if made_here
            else ""
        )
        raise ValueError(f"{where}: logprobs has {len(lp)} entries for {n} completion tokens{why}")
    out = []
    for j, x in enumerate(lp):
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)) or x > 0:
            raise ValueError(f"{where}: logprobs[{j}] = {x!r} is not a log-probability (a finite number <= 0)")
        out.append(float(x))
    return out


def _encode(tokenizer: Any, text: str) -> List[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _extends(prev_messages: Optional[list], messages: Optional[list]) -> bool:
    """Whether ``messages`` is ``prev_messages`` plus one assistant message
    (the previous call's completion) and possibly more (tool results, a new
    user turn): the harness appended and edited nothing."""
    if prev_messages is None or messages is None:
        return False
    n = len(prev_messages)
    if len(messages) <= n or list(messages[:n]) != list(prev_messages):
        return False
    m = messages[n]
    return isinstance(m, dict) and m.get("role") == "assistant"


def from_chat(
    records: Sequence[Dict[str, Any]],
    tokenizer: Any,
    *,
    chat_template: Optional[str] = None,
    template_kwargs: Optional[Dict[str, Any]] = None,
    vocab_size: Optional[int] = None,
    report: bool = True,
) -> ChatRollouts:
    """Chat-log rollouts (``records``, see the module docs) to token
    rollouts for :func:`treeattn.pack`, with a :class:`ChatReport`.

    ``tokenizer``: a transformers tokenizer with a chat template (needed
    only for calls without engine ids). ``chat_template``: a Jinja template
    used instead of the tokenizer's. ``template_kwargs``: more variables for
    the template (``enable_thinking=False``, say), passed to every
    ``apply_chat_template``. ``vocab_size``: engine ids must be below it
    (default ``len(tokenizer)``). ``report=False`` skips the packing that
    measures ``packed_tokens``.

    Passed through: the record's ``"reward"``, ``"group"``, ``"rewards"``
    (one list per call, one number per completion token: checked against
    the completion's length here) and ``"truncated"``, and each call's
    ``"summary"``.

    ``ValueError`` naming the rollout and call: a record or call that is not
    shaped as above, no chat template where one is needed, a template that
    fails to render, an engine id that is not an int in the vocabulary,
    ``logprobs`` or ``rewards`` of another length than the completion, an
    empty context or completion, an assistant message the template cannot
    render after its prompt."""
    if isinstance(records, (str, bytes, dict)) or not isinstance(records, Sequence):
        raise ValueError(f"from_chat: records must be a list of dicts, got {type(records).__name__}")
    if vocab_size is None:
        vocab_size = len(tokenizer)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"from_chat: vocab_size must be a positive int, got {vocab_size!r}")
    tkw = dict(template_kwargs or {})
    for reserved in ("tools", "add_generation_prompt", "tokenize", "chat_template", "continue_final_message"):
        if reserved in tkw:
            raise ValueError(f"from_chat: template_kwargs may not set {reserved!r} (from_chat sets it)")
    has_template = chat_template is not None or getattr(tokenizer, "chat_template", None) is not None

    def render(where: str, messages: list, tools: Any, gen: bool, tokenize: bool) -> Any:
        if not has_template:
            raise ValueError(
                f"{where}: the tokenizer has no chat template (pass chat_template=, or the engine's "
                "prompt_token_ids and completion_token_ids)"
            )
        try:
            out = tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=chat_template, add_generation_prompt=gen,
                tokenize=tokenize, return_dict=False, **tkw,
            )
        except ValueError as e:
            raise ValueError(f"{where}: the chat template does not render these messages: {e}") from e
        except Exception as e:  # jinja2 errors (a template's raise_exception), TypeErrors from filters
            raise ValueError(
                f"{where}: the chat template does not render these messages: {type(e).__name__}: {e}"
            ) from e
        return list(out) if tokenize else out

    rep = ChatReport()
    out: List[Dict[str, Any]] = []
    seen_ids = set()
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"from_chat: records[{i}] is a {type(rec).__name__}, expected a dict")
        rid = rec.get("id")
        w = _Where(i, rid)
        if rid is None or (isinstance(rid, str) and not rid):
            raise ValueError(f"{w()}: a record needs a non-empty \"id\"")
        if rid in seen_ids:
            raise ValueError(f"{w()}: the id is used by an earlier record (ids are unique)")
        seen_ids.add(rid)
        calls = rec.get("calls")
        if not isinstance(calls, list) or not calls:
            raise ValueError(f"{w()}: \"calls\" must be a non-empty list")
        rewards = rec.get("rewards")
        if rewards is not None and (not isinstance(rewards, list) or len(rewards) != len(calls)):
            raise ValueError(
                f"{w()}: \"rewards\" must be one list per call ({len(calls)}), got "
                f"{len(rewards) if isinstance(rewards, list) else type(rewards).__name__}"
            )
        token_calls = []
        stats = {"id": rid, "calls": len(calls), "retokenized": 0, "junctions": 0, "template_junctions": 0,
                 "tokens": 0, "packed_tokens": None}
        prev_seq: Optional[List[int]] = None
        prev_messages: Optional[list] = None
        for c, call in enumerate(calls):
            where = w(c)
            if not isinstance(call, dict):
                raise ValueError(f"{where}: a call is a dict, got {type(call).__name__}")
            messages = call.get("messages")
            if messages is not None and (not isinstance(messages, list) or not messages):
                raise ValueError(f"{where}: \"messages\" must be a non-empty list of messages")
            tools = call.get("tools", rec.get("tools"))
            made = False
            # Context.
            if call.get("prompt_token_ids") is not None:
                context = _ids(where, "prompt_token_ids", call["prompt_token_ids"], vocab_size)
            else:
                if messages is None:
                    raise ValueError(f"{where}: a call needs \"messages\" or the engine's \"prompt_token_ids\"")
                context = render(where, messages, tools, True, True)
                rep.retokenized_contexts += 1
                made = True
            # Completion.
            completion_made = False
            if call.get("completion_token_ids") is not None:
                completion = _ids(where, "completion_token_ids", call["completion_token_ids"], vocab_size)
            else:
                comp = call.get("completion")
                if isinstance(comp, str):
                    completion = _encode(tokenizer, comp)
                elif isinstance(comp, dict):
                    if messages is None:
                        raise ValueError(
                            f"{where}: an assistant-message completion is rendered after the call's \"messages\", "
                            "which the call lacks"
                        )
                    if comp.get("role", "assistant") != "assistant":
                        raise ValueError(
                            f"{where}: a message completion has role \"assistant\", got {comp.get('role')!r}"
                        )
                    msg = dict(comp, role="assistant")
                    prompt_text = render(where, messages, tools, True, False)
                    full = render(where, list(messages) + [msg], tools, False, False)
                    if not full.startswith(prompt_text):
                        k = next((j for j, (a, b) in enumerate(zip(prompt_text, full)) if a != b),
                                 min(len(prompt_text), len(full)))
                        raise ValueError(
                            f"{where}: the chat template cannot render this assistant message after its prompt: "
                            f"the prompt's render (with the generation prompt) is not a prefix of the conversation "
                            f"rendered with the message (they part at character {k}: prompt "
                            f"{prompt_text[k:k + 40]!r}, with the message {full[k:k + 40]!r}); pass the sampled "
                            "text or the engine's completion_token_ids"
                        )
                    completion = _encode(tokenizer, full[len(prompt_text):])
                else:
                    raise ValueError(
                        f"{where}: \"completion\" must be the sampled text or an assistant message (dict), or give "
                        f"the engine's \"completion_token_ids\"; got {type(comp).__name__}"
                    )
                rep.retokenized_completions += 1
                made = completion_made = True
            if not context:
                raise ValueError(f"{where}: the context is empty (the first completion token needs a predicting row)")
            if not completion:
                raise ValueError(f"{where}: the completion is empty (no token to train)")
            tc: Dict[str, Any] = {"context": context, "completion": completion}
            lp = call.get("logprobs")
            if lp is not None:
                tc["logprobs"] = _logprobs(where, lp, len(completion), completion_made)
            if rewards is not None:
                rc = rewards[c]
                if not isinstance(rc, list) or len(rc) != len(completion):
                    raise ValueError(
                        f"{where}: rewards[{c}] has "
                        f"{len(rc) if isinstance(rc, list) else type(rc).__name__} entries for "
                        f"{len(completion)} completion tokens"
                        + (" (the completion was tokenized here)" if completion_made else "")
                    )
            for f in _CALL_FIELDS:
                if call.get(f) is not None:
                    tc[f] = call[f]
            token_calls.append(tc)
            # Junctions.
            if prev_seq is not None:
                n = len(prev_seq)
                if not (len(context) >= n and context[:n] == prev_seq):
                    stats["junctions"] += 1
                    if _extends(prev_messages, messages):
                        stats["template_junctions"] += 1
            prev_seq = context + completion
            prev_messages = messages
            stats["tokens"] += len(context) + len(completion)
            rep.calls += 1
            if made:
                rep.retokenized_calls += 1
                stats["retokenized"] += 1
        r: Dict[str, Any] = {"id": rid}
        for f in _ROLLOUT_FIELDS:
            if rec.get(f) is not None:
                r[f] = rec[f]
        r["calls"] = token_calls
        out.append(r)
        rep.rollouts.append(stats)
    if report and out:
        from . import pack

        (p,) = pack(out, share_prefixes=False)
        for s, st in zip(rep.rollouts, p.stats):
            s["packed_tokens"] = int(st["trie_tokens"])
    return ChatRollouts(out, rep)
