"""A seeded, agent-like sample session (the project's own data): a coding agent with hidden
reasoning, shell commands and long tool output, tens of thousands of tokens. The same seed gives
the same conversation on every machine, so the README's first command needs no download."""

from __future__ import annotations

import random

from shadow.text.chat import Message
from shadow.text.conversations import Conversation

WORDS = (
    "cache session reader chunk grid state token prompt buffer layer config model index row "
    "request stream window share budget store file path table record parser handler queue "
    "worker batch offset length value result error limit timer clock event journal ledger"
).split()
MODULES = ("store", "reader", "ledger", "parser", "server", "schedule", "journal", "config")
STEPS = (
    ("list the package", "find src -name '*.py' | sort"),
    ("read the module", "cat -n src/pkg/{mod}.py"),
    ("search for the helper", "grep -rn '{fn}' src/ tests/"),
    ("run the failing test", "python -m pytest tests/test_{mod}.py -x -q"),
    ("edit the function", "sed -i 's/{fn}(x)/{fn}(x, strict=True)/' src/pkg/{mod}.py"),
    ("check the diff", "git diff src/pkg/{mod}.py"),
)


def sample_conversation(seed: int = 0, turns: int = 24) -> Conversation:
    """An agent session of `turns` requests (about 1,000 tokens each on average)."""
    rng = random.Random(seed)
    messages = [
        Message("system", "You are a careful software agent. Each reply holds one THOUGHT and exactly one "
                "bash command in a fenced block. Work in small steps and read before you edit."),
        Message("user", _task(rng)),
    ]
    for turn in range(turns):
        mod, fn = rng.choice(MODULES), _name(rng)
        goal, command = rng.choice(STEPS)
        command = command.format(mod=mod, fn=fn)
        reasoning = " ".join(
            f"I need to {goal} to see how `{fn}` handles the {rng.choice(WORDS)} {rng.choice(WORDS)}."
            for _ in range(rng.randint(1, 4))
        )
        content = f"THOUGHT: Next I {goal} in `{mod}`; turn {turn + 1}.\n\n```bash\n{command}\n```"
        messages.append(Message("assistant", content, reasoning))
        messages.append(Message("user", _observation(rng, mod, fn)))
    messages.append(Message("assistant", "THOUGHT: The fix is in place and the tests pass.\n\n```bash\n"
                            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```", "All checks pass."))
    return Conversation(name=f"sample-seed{seed}", messages=tuple(messages))


def _name(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"


def _task(rng: random.Random) -> str:
    fn = _name(rng)
    return (
        "<pr_description>\n"
        f"`{fn}` returns stale rows after a rollback when the {rng.choice(WORDS)} is evicted.\n"
        "Steps to reproduce: feed two turns, evict, feed a third. Expected: fresh rows.\n"
        "</pr_description>\n\nFix the bug in src/pkg and keep the tests green."
    )


def _observation(rng: random.Random, mod: str, fn: str) -> str:
    lines = []
    for i in range(rng.randint(20, 160)):
        kind = rng.random()
        a, b = rng.choice(WORDS), rng.choice(WORDS)
        if kind < 0.5:
            lines.append(f"{i + 1:6d}\t    {a}_{b} = self.{b}.get({rng.randint(0, 4096)}, {a!r})")
        elif kind < 0.7:
            lines.append(f"{i + 1:6d}\tdef {fn if rng.random() < 0.1 else a + '_' + b}(self, {a}, {b}=None):")
        elif kind < 0.85:
            lines.append(f"src/pkg/{mod}.py:{rng.randint(1, 900)}: {a}.{b}({rng.randint(0, 99)})")
        else:
            lines.append(f"tests/test_{mod}.py::test_{a}_{b} {'PASSED' if rng.random() < 0.8 else 'FAILED'}")
    return f"<returncode>{rng.choice((0, 0, 0, 1))}</returncode>\n<output>\n" + "\n".join(lines) + "\n</output>"
