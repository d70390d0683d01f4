"""The templated English and code of the embedded sample data (scripts/tools/make_sample_data.py):
`Gen` draws instructions, chats and texts from one seeded `random.Random`, so a rerun is
byte-identical (the words from `sample_words`, the coding tasks from `sample_code`)."""

from __future__ import annotations

import math
import random

from .sample_code import CODE_TASKS
from .sample_words import (
    ADJECTIVES,
    ADJS,
    CITIES,
    CONNECTORS,
    EFFECTS,
    GERUNDS,
    GOALS,
    GOODS,
    INFORMAL,
    ITEMS,
    NAMES,
    NOUN_PHRASES,
    NOUNS,
    PERIODS,
    REVIEWS,
    SENTENCES,
    THINGS,
    TOPICS,
    VERB_PHRASES,
    VERBS,
    WORD_SENTENCES,
    cap,
)

# Rough characters per token of the trained tokenizer on this text; used only to aim lengths.
CHARS_PER_TOKEN = 4.3

# ------------------------------------------------------------------------------------ text pieces


class Gen:
    """Seeded generators of sentences, paragraphs and whole examples."""

    def __init__(self, rng: random.Random) -> None:
        self.r = rng

    def word_sentence(self) -> str:
        r = self.r
        noun, noun2 = r.sample(NOUNS, 2)
        verb, verb2 = r.sample(VERBS, 2)
        return r.choice(WORD_SENTENCES).format(
            adj=r.choice(ADJS),
            noun=noun,
            noun2=noun2,
            verb=verb,
            verb2=verb2,
            Name=r.choice(NAMES)[0],
            city=r.choice(CITIES),
            period=r.choice(PERIODS),
        )

    def sentence(self, topic: str) -> str:
        r = self.r
        if r.random() < 0.3:
            return self.word_sentence()
        t = r.choice(SENTENCES)
        vp, vp2 = r.sample(VERB_PHRASES, 2)
        np_, np2 = r.sample(NOUN_PHRASES, 2)
        s = t.format(
            Topic=cap(topic),
            topic=topic,
            adj=r.choice(ADJECTIVES),
            np=np_,
            np2=np2,
            vp=vp,
            vp2=vp2,
            ger=r.choice(GERUNDS),
            conn=r.choice(CONNECTORS),
            effect=r.choice(EFFECTS),
            num=r.randint(2, 5),
            period=r.choice(PERIODS),
            Name=r.choice(NAMES)[0],
        )
        return cap(s)

    def paragraph(self, topic: str, n: int | None = None) -> str:
        n = n if n is not None else self.r.randint(3, 6)
        return " ".join(self.sentence(topic) for _ in range(n))

    def paragraphs_until(self, topic: str, chars: int, head: str = "") -> str:
        """Append paragraphs (sometimes headed sections or lists) until `chars` characters."""
        parts = [head] if head else []
        size = len(head)
        section = 1
        while size < chars:
            roll = self.r.random()
            if roll < 0.12 and chars > 1500:
                p = f"## Part {section}: {cap(self.r.choice(GERUNDS))}\n\n" + self.paragraph(topic)
                section += 1
            elif roll < 0.24:
                p = self.numbered_list(topic, self.r.randint(3, 6))
            else:
                p = self.paragraph(topic)
            parts.append(p)
            size += len(p) + 2
        return "\n\n".join(parts)

    def numbered_list(self, topic: str, n: int) -> str:
        items = self.r.sample(VERB_PHRASES, n)
        lines = []
        for i, vp in enumerate(items, 1):
            extra = self.sentence(topic) if self.r.random() < 0.6 else ""
            lines.append(f"{i}. **{cap(vp)}.** {extra}".rstrip())
        return "\n".join(lines)

    # ---------------------------------------------------------------------- instruction kinds

    def arithmetic(self) -> tuple[str, str, str]:
        r = self.r
        (name, he), (friend, _) = r.sample(NAMES, 2)
        He = cap(he)
        his = {"he": "his", "she": "her"}[he]
        kind = r.randrange(5)
        if kind == 0:
            item = r.choice(ITEMS)
            a, b = r.randint(5, 60), r.randint(2, 40)
            c = r.randint(1, a + b - 1)
            q = f"{name} has {a} {item}. {He} buys {b} more and then gives {c} to {friend}. How many {item} does {name} have now?"
            s = (
                f"After buying more, {name} has {a} + {b} = {a + b} {item}.\n"
                f"After giving {c} to {friend}, {he} has {a + b} - {c} = {a + b - c} {item}.\n"
                f"#### {a + b - c}"
            )
        elif kind == 1:
            good, price = r.choice(GOODS)
            n = r.randint(2, 9)
            paid = ((price * n) // 10 + 1 + r.randint(0, 3)) * 10
            q = f"A {good} costs ${price}. {name} buys {n} of them and pays with ${paid}. How much change does {he} get?"
            s = (
                f"The total cost is {n} x ${price} = ${n * price}.\n"
                f"The change is ${paid} - ${n * price} = ${paid - n * price}.\n#### {paid - n * price}"
            )
        elif kind == 2:
            item = r.choice(ITEMS)
            per, boxes = r.randint(3, 12), r.randint(2, 12)
            friends = r.choice([d for d in range(2, 9) if (per * boxes) % d == 0] or [1])
            total = per * boxes
            q = (
                f"{name} has {boxes} boxes with {per} {item} in each box. {He} shares all the {item} "
                f"equally among {friends} friends. How many {item} does each friend get?"
            )
            s = (
                f"{name} has {boxes} x {per} = {total} {item} in total.\n"
                f"Each friend gets {total} / {friends} = {total // friends} {item}.\n#### {total // friends}"
            )
        elif kind == 3:
            good, price = r.choice(GOODS)
            price *= 10
            pct = r.choice([10, 20, 25, 50])
            off = price * pct // 100
            q = f"A {good} normally costs ${price}. This week it is {pct}% off. How much does {name} pay for it this week?"
            s = f"The discount is {pct}% of ${price} = ${off}.\n{name} pays ${price} - ${off} = ${price - off}.\n#### {price - off}"
        else:
            speed, hours, extra = r.randint(30, 90), r.randint(2, 6), r.randint(10, 80)
            q = (
                f"{name} drives at {speed} miles per hour for {hours} hours and then drives another "
                f"{extra} miles to reach {his} friend {friend}. How many miles does {he} drive in total?"
            )
            s = (
                f"In {hours} hours {he} drives {speed} x {hours} = {speed * hours} miles.\n"
                f"In total {he} drives {speed * hours} + {extra} = {speed * hours + extra} miles.\n"
                f"#### {speed * hours + extra}"
            )
        instr = r.choice(["Solve the following math word problem step by step.", "Answer the question and show your reasoning.", q])
        if instr == q:
            return q, "", s
        return instr, q, s

    def code(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        task, fname, body, call, result = r.choice(CODE_TASKS)(r)
        lang_intro = r.choice(
            [
                "Here is a simple Python function that does this:",
                "You can solve this with a short Python function:",
                "One clear way to write it in Python:",
            ]
        )
        code = f"```python\n{body}\n```"
        expl = self.paragraph("unit testing", r.randint(1, 2))
        example = f"Example:\n\n```python\n>>> {call}\n{result}\n```"
        out = f"{lang_intro}\n\n{code}\n\n{example}\n\n{expl}"
        if len(out) < target_chars:
            out = self.paragraphs_until(r.choice(["unit testing", "caching", "version control", "database indexing"]), target_chars, out)
        instr = r.choice(
            [f"Write a Python function `{fname}` that {task}.", f"Implement {task} in Python.", f"How do I write a function that {task}?"]
        )
        return instr, "", out

    def tips(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        goal = r.choice(GOALS)
        n = max(3, min(10, target_chars // 150))
        instr = r.choice(
            [
                f"Give me {n} tips for {goal}.",
                f"List {n} ways to get better at {goal}.",
                f"What are {n} practical pieces of advice for {goal}?",
            ]
        )
        out = f"Here are {n} tips for {goal}:\n\n" + self.numbered_list(goal, min(n, len(VERB_PHRASES)))
        if len(out) < target_chars:
            out = self.paragraphs_until(goal, target_chars, out)
        return instr, "", out

    def explain(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        topic = r.choice(TOPICS)
        instr = r.choice(
            [
                f"Explain {topic} in simple terms.",
                f"What should I know about {topic}?",
                f"Write a short overview of {topic}.",
                f"Why does {topic} matter?",
            ]
        )
        return instr, "", self.paragraphs_until(topic, target_chars)

    def guide(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        topic = r.choice(TOPICS)
        instr = f"Write a detailed guide to {topic} for beginners, with sections, examples and a checklist at the end."
        head = f"# A beginner's guide to {topic}\n\n" + self.paragraph(topic)
        body = self.paragraphs_until(topic, target_chars - 400, head)
        return instr, "", body + "\n\n## Checklist\n\n" + self.numbered_list(topic, 5)

    def summarize(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        topic = r.choice(TOPICS)
        text = self.paragraphs_until(topic, max(200, int(target_chars * 0.8)))
        instr = r.choice(["Summarize the following text in two sentences.", "Write a one-paragraph summary of this passage.", "TL;DR:"])
        return instr, text, self.paragraph(topic, 2)

    def words_task(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        pick = r.random()
        if pick < 0.4:
            words = r.sample(NOUNS + VERBS + ADJS, max(4, min(60, target_chars // 16)))
            return ("Sort the following words in alphabetical order.", ", ".join(words), ", ".join(sorted(words)))
        if pick < 0.7:
            word = r.choice(NOUNS)
            out = " ".join(self.word_sentence() for _ in range(r.randint(1, 3)))
            out = f'Here is a sentence with the word "{word}": The {r.choice(ADJS)} {word} was easy to {r.choice(VERBS)}. {out}'
            return f'Use the word "{word}" in a sentence.', "", out
        city = r.choice(CITIES)
        n = r.randint(3, 6)
        lines = [f"- {cap(r.choice(VERBS))} the {r.choice(ADJS)} {r.choice(NOUNS)}" for _ in range(n)]
        return (f"Make a short to-do list for a weekend in {city}.", "", f"Weekend in {city}:\n" + "\n".join(lines))

    def short(self) -> tuple[str, str, str]:
        r = self.r
        if r.random() < 0.6:
            tmpl, label = r.choice(REVIEWS)
            return ("Classify the sentiment of this review as Positive, Negative or Neutral.", tmpl.format(thing=r.choice(THINGS)), label)
        src, dst = r.choice(INFORMAL)
        return "Rewrite the following sentence in a formal tone.", src, dst

    def instruction(self, target_tokens: int) -> dict[str, str]:
        chars = int(target_tokens * CHARS_PER_TOKEN)
        r = self.r
        if target_tokens < 45:
            ex = self.short()
        elif target_tokens < 130 and r.random() < 0.55:
            ex = self.arithmetic()
        elif target_tokens < 400 and r.random() < 0.3:
            ex = self.words_task(chars)
        else:
            pick = r.random()
            if pick < 0.25:
                ex = self.code(chars)
            elif pick < 0.45:
                ex = self.tips(chars)
            elif pick < 0.75:
                ex = self.explain(chars)
            elif pick < 0.9:
                ex = self.summarize(chars)
            else:
                ex = self.guide(chars)
        return {"instruction": ex[0], "input": ex[1], "output": ex[2]}

    # ---------------------------------------------------------------------- chat and text

    def chat(self) -> dict[str, list[dict[str, str]]]:
        r = self.r
        msgs: list[dict[str, str]] = []
        if r.random() < 0.6:
            msgs.append(
                {
                    "role": "system",
                    "content": r.choice(
                        [
                            "You are a helpful assistant.",
                            "You are a patient tutor. Explain things step by step.",
                            "You are a concise assistant. Keep answers short and accurate.",
                            "You are a friendly coding assistant who writes clear Python.",
                        ]
                    ),
                }
            )
        topic = r.choice(TOPICS)
        for turn in range(r.randint(1, 4)):
            target = int(min(3000, r.lognormvariate(math.log(90), 0.7)) * CHARS_PER_TOKEN)
            if turn == 0:
                kind = r.random()
                if kind < 0.3:
                    q, a = self._chat_math()
                elif kind < 0.5:
                    ins, _, a = self.code(target)
                    q = ins
                else:
                    q = r.choice([f"Can you explain {topic}?", f"I keep hearing about {topic}. What is it?", f"How does {topic} work?"])
                    a = self.paragraphs_until(topic, target)
            else:
                follow = r.randrange(4)
                if follow == 0:
                    q, a = "Can you make that shorter?", self.paragraph(topic, 2)
                elif follow == 1:
                    q = "Thanks! Can you give me a concrete example?"
                    a = f"Sure. {self.sentence(topic)} {self.paragraph(topic, r.randint(2, 4))}"
                elif follow == 2:
                    topic = r.choice(TOPICS)
                    q = f"What about {topic}?"
                    a = self.paragraphs_until(topic, target)
                else:
                    goal = r.choice(GOALS)
                    q = f"Any tips for {goal}?"
                    a = self.numbered_list(goal, r.randint(3, 6))
            msgs.append({"role": "user", "content": q})
            msgs.append({"role": "assistant", "content": a})
        return {"messages": msgs}

    def _chat_math(self) -> tuple[str, str]:
        instr, q, s = self.arithmetic()
        return (q or instr), s.replace("\n#### ", "\nThe answer is ") + "."

    def text(self) -> dict[str, str]:
        r = self.r
        topic = r.choice(TOPICS)
        target = int(min(4000, r.lognormvariate(math.log(220), 0.8)) * CHARS_PER_TOKEN)
        title = r.choice(
            [f"Notes on {topic}", f"{cap(topic)}: a short introduction", f"What I learned about {topic}", f"Thinking about {topic}"]
        )
        return {"text": self.paragraphs_until(topic, target, title)}
