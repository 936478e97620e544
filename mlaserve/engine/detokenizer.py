"""Output text and stop strings for one request.

Text is re-decoded from all output ids (simple, and exact at token boundaries that split a UTF-8 character);
only the tail that the new token could have changed is searched for stop strings.
"""

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestText:
    stop: list[str]
    include_stop: bool
    skip_special_tokens: bool
    text: str = ""
    stop_reason: str | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)

    def visible_text(self, finished: bool) -> str:
        """While running, hold back what could still become the start of a stop string (as vLLM does)."""
        if finished or not self.stop:
            return self.text
        hold = max(len(s) for s in self.stop) - 1
        return self.text[: len(self.text) - hold] if hold else self.text

    def update(self, tokenizer: object, output_ids: list[int]) -> bool:
        """Refresh the text after a new token; True if a stop string now ends the output."""
        previous = len(self.text)
        self.text = tokenizer.decode(output_ids, skip_special_tokens=self.skip_special_tokens)
        if not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        search_from = max(0, previous - longest + 1)
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
        self.stop_reason = stop
        return True
