"""A deterministic engine for tests that need the policy to emit specific outputs.

It implements the `Engine` protocol with real token ids from the real tokenizer: ACT prompts get
`act_text`, REHEARSE prompts (recognised by their system prompt) get `rehearse_text`. Only the
model is replaced; the environment, prompts, parsers and scoring under test are the real ones.
"""

from envace_core.engines.base import Completion, SamplingParams


class ScriptedEngine:
    def __init__(self, tokenizer, act_texts, rehearse_text='{"status": "ok"}'):
        self.tokenizer = tokenizer
        self.act_texts = list(act_texts)  # consumed per ACT turn index; the last one repeats
        self.rehearse_text = rehearse_text
        self.calls = []
        self.stats = {}

    def _completion(self, text):
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")

    def generate(self, prompts, params: SamplingParams):
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            rehearse = "You simulate the" in text
            self.calls.append("rehearse" if rehearse else "act")
            if rehearse:
                reply = self.rehearse_text
            else:
                turn = text.count("<|im_start|>assistant") - 1
                reply = self.act_texts[min(turn, len(self.act_texts) - 1)]
            out.append([self._completion(reply) for _ in range(params.n)])
        return out
