"""Generated token ids to text, piece by piece, with OpenAI's ``stop`` strings.

:class:`TextStream` turns each new token into the text it adds, decoding a
short window (a few prompt tokens for context, so a leading space or a
multi-byte character comes out as it does in the whole text) and holding
back what could still be the start of a stop string or an unfinished
character. Joined, its pieces equal ``decode(prompt + generated)`` minus
``decode(prompt)`` for tokenizers whose decoding of a prefix is a prefix of
the decoding (all the usual ones), cut before the first stop string.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["TextStream"]

_CONTEXT = 6          # prompt tokens decoded before the first new one
_REPLACEMENT = "\ufffd"


class TextStream:
    """Incremental detokenization of one completion.

    ``push(token)`` returns the text that can be sent now; ``finish()`` the
    rest. Once a stop string is seen, ``stopped`` is True and no more text
    comes.
    """

    def __init__(self, tokenizer: Any, prompt: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        context = list(prompt[-_CONTEXT:])
        self._ids: list[int] = context
        self._prefix = 0              # window start in _ids
        self._read = len(context)     # ids up to here are already turned into text
        self._stop = tuple(s for s in stop if s)
        self._held = ""               # decoded but not sent (could start a stop string)
        self.text = ""                # everything sent
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(int(token))
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""      # nothing new yet, or half a character
        new = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        return self._emit(self._held + new)

    def finish(self) -> str:
        """What is left once generation ended (the held-back tail, if no stop string came)."""
        if self.stopped:
            return ""
        out, self._held = self._held, ""
        self.text += out
        return out

    def _emit(self, pending: str) -> str:
        cut = min((i for i in (pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            out = pending[:cut]
            self._held = ""
            self.stopped = True
        else:
            keep = self._partial_stop(pending)
            out, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += out
        return out

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-n:]):
                    best = n
                    break
        return best
