#!/usr/bin/env python
"""Generate the embedded sample data and the sample tokenizer, deterministically.

    python scripts/make_sample_data.py                 # rewrites data/sample/ and data/tokenizer/
    python scripts/make_sample_data.py --out /tmp/x    # same files under /tmp/x/sample, /tmp/x/tokenizer

Everything comes from one fixed seed and templated English (sentences, lists, code snippets,
arithmetic word problems built from the vocabularies below), so a rerun is byte-identical;
`tests/scripts/test_sample_data.py` checks that against the committed files. Files written:

- sample/instructions.jsonl  {instruction, input, output}; lognormal lengths (median ~120 tokens,
                             most 50-500, a tail into thousands, 3 examples > 8192 tokens)
- sample/chat.jsonl          {messages: [{role, content}, ...]}, multi-turn, optional system prompt
- sample/text.jsonl          {text}
- tokenizer/                 byte-level BPE (vocab 4096) trained on the three files with `tokenizers`,
                             saved in Hugging Face format (tokenizer.json + tokenizer_config.json),
                             loadable with `transformers.AutoTokenizer.from_pretrained`.
- GENERATED.json             seed, library versions and sha256 of every file above.

The tokenizer does NOT add BOS/EOS by itself (no template post-processor, add_bos_token=False): the
packing pipeline adds BOS/EOS explicitly so that it controls where they go and can count them.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import OneLineParser, check_output, check_output_folder, write_output, write_text_output  # noqa: E402

SEED = 20240611
N_INSTRUCTIONS = 3000
N_CHAT = 300
N_TEXT = 300
SAMPLE_FILES = ("sample/instructions.jsonl", "sample/chat.jsonl", "sample/text.jsonl")  # under --out
VOCAB_SIZE = 4096
# Rough characters per token of the trained tokenizer on this text; used only to aim lengths.
CHARS_PER_TOKEN = 4.3
# Target lengths (in tokens) of the forced very long examples: past 8192 so truncation shows up.
LONG_TARGETS = (10500, 12500, 16000)

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, IM_START, IM_END]  # ids 0..5 in this order

# ChatML-like; the {% generation %} block marks assistant tokens so that
# `apply_chat_template(..., return_assistant_tokens_mask=True)` can find them.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ------------------------------------------------------------------------------------ vocabulary

NAMES = [
    ("Maria", "she"), ("James", "he"), ("Aisha", "she"), ("Chen", "he"), ("Olivia", "she"),
    ("Kofi", "he"), ("Lucas", "he"), ("Priya", "she"), ("Sofia", "she"), ("Mateo", "he"),
    ("Hannah", "she"), ("Yuki", "she"), ("Omar", "he"), ("Elena", "she"), ("Noah", "he"),
    ("Fatima", "she"), ("Liam", "he"), ("Grace", "she"), ("Ravi", "he"), ("Zoe", "she"),
    ("Daniel", "he"), ("Amara", "she"), ("Tom", "he"), ("Lena", "she"), ("Ibrahim", "he"),
]
ITEMS = [
    "apples", "pencils", "books", "marbles", "stickers", "cookies", "tickets", "coins", "seeds",
    "cards", "oranges", "cupcakes", "notebooks", "shells", "stamps", "balloons", "eggs", "flowers",
]
GOODS = [
    ("notebook", 3), ("sandwich", 6), ("movie ticket", 12), ("plant", 8), ("pair of socks", 5),
    ("bag of rice", 14), ("bottle of juice", 2), ("book", 15), ("board game", 25), ("scarf", 18),
]
TOPICS = [
    "photosynthesis", "the water cycle", "compound interest", "version control", "binary search",
    "climate change", "healthy sleep", "a balanced diet", "public speaking", "time management",
    "recycling", "volcanoes", "the immune system", "machine learning", "unit testing",
    "personal budgeting", "vegetable gardening", "remote work", "renewable energy", "memory",
    "the solar system", "supply and demand", "database indexing", "caching", "team meetings",
    "learning a new language", "electric cars", "bird migration", "ocean tides", "password security",
]
GOALS = [
    "studying for an exam", "saving money", "staying focused", "writing clean code",
    "running a small business", "learning to cook", "training for a 10k run", "reducing stress",
    "organizing a home office", "preparing for a job interview", "reading more books",
    "keeping a garden healthy", "working in a remote team", "debugging a program",
    "giving better feedback", "planning a trip", "sleeping better", "taking useful notes",
]
VERB_PHRASES = [
    "review your notes", "set a clear goal", "measure the results", "write down the steps",
    "ask for feedback", "break the task into smaller parts", "compare several options",
    "check your assumptions", "keep a simple log", "test one change at a time",
    "plan the week ahead", "remove distractions", "start with the hardest part",
    "take short breaks", "explain the idea to someone else", "read the documentation",
    "track your progress", "set a realistic deadline", "focus on one thing at a time",
    "look at the data before deciding", "keep the first version simple", "ask a clear question",
]
GERUNDS = [
    "understanding the problem", "reading the instructions", "checking the data",
    "planning the budget", "talking to the team", "setting up the tools", "writing a short outline",
    "measuring the baseline", "looking at earlier examples", "agreeing on the goal",
]
NOUN_PHRASES = [
    "a clear plan", "small daily habits", "the quality of the input", "careful measurement",
    "regular practice", "the available time", "good communication", "the size of the team",
    "the cost of materials", "a steady routine", "the amount of sunlight", "the choice of tools",
    "a good night of sleep", "simple checklists", "the weather", "early feedback",
    "the order of the steps", "the temperature", "clear naming", "the number of users",
    "a quiet place to work", "honest estimates", "the local climate", "a written summary",
]
EFFECTS = ["improve", "reduce", "change", "slow down", "speed up", "simplify", "shape", "limit"]
ADJECTIVES = [
    "important", "useful", "simple", "common", "surprising", "practical", "reliable", "flexible",
    "difficult", "helpful", "effective", "popular",
]
PERIODS = ["day", "week", "month"]
CONNECTORS = [
    "In practice,", "For example,", "However,", "As a result,", "In many cases,", "Over time,",
    "At the same time,", "In short,", "On the other hand,", "Most of the time,",
]
SENTENCES = [
    "{Topic} is {adj} because it affects {np} and {np2}.",
    "One {adj} mistake is to {vp} without first {ger}.",
    "{conn} {np} can {effect} {np2}.",
    "A good way to start is to {vp}.",
    "Many people find it {adj} to {vp} at least {num} times a {period}.",
    "{Name} once tried to {vp} and noticed that {np} made a big difference.",
    "When you think about {topic}, remember that {np} matters more than it seems.",
    "{conn} it helps to {vp} and then {vp2}.",
    "The key idea behind {topic} is that {np} and {np2} work together.",
    "If something goes wrong, {vp} before changing anything else.",
    "Researchers who study {topic} often point to {np} as a {adj} factor.",
    "{conn} the best results come from {ger} and keeping {np} in mind.",
    "It is {adj} to notice how {np} can {effect} the outcome.",
    "Try to {vp}; it takes a few minutes and saves hours later.",
    "There is no single rule, but {np} usually helps.",
    "A simple checklist makes it easier to {vp}.",
]
REVIEWS = [
    ("The {thing} arrived on time and works exactly as described.", "Positive"),
    ("I love this {thing}; it is easy to use and looks great.", "Positive"),
    ("Great value for the price, and the {thing} feels solid.", "Positive"),
    ("The {thing} broke after two days and support never answered.", "Negative"),
    ("Disappointing {thing}. It is much smaller than the pictures suggest.", "Negative"),
    ("I would not buy this {thing} again; it stopped working quickly.", "Negative"),
    ("The {thing} is fine. Nothing special, but it does the job.", "Neutral"),
    ("It is an average {thing}; some parts are good and some are not.", "Neutral"),
]
THINGS = ["lamp", "kettle", "backpack", "keyboard", "blender", "chair", "phone case", "headset"]
INFORMAL = [
    ("gonna need that report asap", "I will need the report as soon as possible."),
    ("can't make it to the meeting, sorry", "I apologize, but I will not be able to attend the meeting."),
    ("the app is kinda slow today", "The application is somewhat slow today."),
    ("thanks a lot for the help!", "Thank you very much for your assistance."),
    ("we should totally try the new plan", "We should consider adopting the new plan."),
    ("lemme know if u have questions", "Please let me know if you have any questions."),
]

# Larger word lists (common English) so the BPE has enough distinct words to fill a 4096 vocabulary.
NOUNS = """
account acid action activity actor address adult advice afternoon agency agent agreement air airport
alarm album amount angle animal answer apartment apple area argument arm army arrival article artist
aspect attempt attention audience author avenue baby background bag bakery balance ball band bank
basket bath battery beach bean bear bed bedroom bee beginning bell belt bench bicycle bill bird
birthday blanket block blood board boat body bone bonus border bottle bottom bowl box boy brain branch
bread breakfast brick bridge brother brush bucket budget building bus business butter button cabin
cable cake calendar camera camp candle canvas capital car card career carpet carrot castle cat cattle
ceiling cell center century chain chair chalk champion channel chapter charge cheese chef chemistry
chest chicken child chocolate church circle citizen city class classroom client climate clock cloth
cloud coach coast coat coffee collar college color column comedy comment committee community company
computer concert condition contract cookie corner cotton council country county courage course court
cousin cow crack crew crop crowd culture cup curtain customer cycle dance danger daughter deal debate
decision deer degree delivery dentist desert desk detail device diamond diary dinner direction
director dirt discount disease dish distance doctor document dog door dragon drawer drawing dream
dress drink driver drum duck dust eagle ear earth economy edge editor education egg election
elephant elevator emergency emotion employee energy engine engineer entrance envelope equipment error
evening event evidence exam example exercise experience expert eye face factory family farm farmer
father fault feather feeling fence festival field figure file film finger fire fish flag flavor
flight floor flower fog folder food foot forest fork fountain fox frame freedom friend fruit fuel
function furniture future game garage garden gate gift girl glass glove goal goat gold government
grain grandmother grape grass ground group guest guide guitar habit hair hall hammer hand harbor hat
health heart heat helmet highway hill history hobby hole holiday honey horse hospital hotel hour house
husband ice idea image income industry insect instance instrument interest internet invention iron
island jacket jar job journey judge juice jungle key kid kitchen kite knee knife ladder lake lamp
language laptop lawyer leader leaf lecture lesson letter library light lion list loan lock lunch
machine magazine manager map market match meal meat medicine member memory message metal method
midnight milk minute mirror mistake model moment money monkey month moon morning mother mountain
mouse mouth movie muscle museum music nature neck needle neighbor nest network newspaper night noise
note number nurse ocean office oil onion opinion orange order oven owner package page pain painting
pair palace paper parent park partner party passenger path patient pattern payment peace pencil
people pepper period person phone photo piano picture piece pillow pilot pizza planet plate player
pocket poem police pond pool potato powder power present president price prince printer prison prize
problem process product profit program project property pumpkin puzzle quality queen question rabbit
radio rain reason recipe record region report research restaurant result review rice river road robot
rock roof room root rope rule salad salt sand school science scissors screen sea season seat secret
secretary shadow sheep shelf ship shirt shoe shop shoulder signal silver singer sister skill skin sky
snake snow soap soccer sock soil soldier song sound soup space speaker speech spider spoon sport
spring square stadium staff stage stairs star station statue steak steel stomach stone storm story
stove street student studio subject sugar suit summer sun supermarket surface survey sweater table
tail teacher team teeth telephone television temple tennis tent theater theory thread ticket tiger
timber toast toilet tomato tongue tool tooth tower town toy track traffic train tree trip truck
tunnel turtle umbrella uncle uniform university valley van vegetable vehicle village violin visitor
voice volume wagon wall wallet war warning watch water wave weather wedding week weight whale wheel
window wine winter wire witness wolf woman wood wool word worker world writer yard year zebra zone
""".split()
VERBS = """
accept add admire adjust agree allow answer appear apply arrange arrive ask attach avoid bake balance
borrow bounce breathe build calculate call carry catch celebrate change check choose clean climb
close collect compare complain complete connect consider contain continue cook copy count cover
create cross cut dance decide decorate deliver describe design destroy develop discover discuss
divide draw dream drive earn edit enjoy enter escape estimate examine explain explore fetch fill find
finish fix fold follow forget gather greet grow guess handle hang help hide hold hunt identify ignore
imagine improve include inform inspect install invent invite join jump kick knock label laugh launch
lead learn lift listen load locate manage mark measure meet mend mix move name notice observe obtain
offer open order organize pack paint pass pay perform pick plan plant play polish pour practice
prepare present print promise protect provide publish pull push question reach read receive record
recycle reduce relax remember remove repair repeat replace reply report request rescue return ride
ring rinse roll rub save scan search select sell send separate serve settle share shift sign sing
sketch slice solve sort speak spell split spread squeeze stack start stir store study supply support
surround switch teach test thank throw touch trace trade train translate travel trust type unlock
update upload visit wait walk wander wash watch water weigh welcome whisper wipe wonder wrap write
""".split()
ADJS = """
able active afraid ancient angry annual anxious automatic average awake basic beautiful big bitter
blank blue bold brave brief bright brilliant broad broken brown busy calm careful casual central
cheap cheerful chemical clean clear clever close cloudy cold comfortable common complex confident
cool correct cozy crazy creative crisp crowded curious cute daily damp dark deep delicate delicious
dense digital direct dirty distant dry dull eager early eastern easy elegant empty energetic entire
equal exact excellent expensive extra fair famous fancy fast fierce final fine flat fluffy foggy
formal fragile free fresh friendly frozen full funny gentle giant glad golden gorgeous grateful great
green grey happy hard healthy heavy helpful hidden high honest hot huge humble hungry icy ideal
immense innocent interesting jolly juicy kind large late lazy legal light little lively local lonely
long loose loud lovely loyal lucky magic major massive mature messy mild minor modern narrow nasty
natural neat nervous new noisy normal obvious odd official old orange ordinary original patient
peaceful perfect plain pleasant polite poor popular powerful precious pretty private proud public
pure purple quick quiet rapid rare raw ready real recent red regular rich rough round royal rural
sad safe salty scared secret serious shallow sharp shiny short shy silent silly similar simple sleepy
slim slow small smart smooth soft solid sour spare special spicy splendid square steady sticky
strange strict strong sudden sunny super sweet swift tall tame tender thick thin tidy tiny tough
tropical typical ugly unusual urban useful valid vast vital warm weak wealthy weekly western wet
whole wide wild windy wise wooden worried yellow young
""".split()
CITIES = """
Amsterdam Athens Bangkok Barcelona Berlin Bogota Boston Brisbane Cairo Chicago Copenhagen Dakar
Delhi Denver Dublin Edinburgh Geneva Hamburg Helsinki Istanbul Jakarta Johannesburg Kyoto Lagos
Lima Lisbon London Madrid Manila Melbourne Mexico Milan Montreal Mumbai Munich Nairobi Oslo Paris
Prague Quito Rome Santiago Seoul Singapore Stockholm Sydney Taipei Tokyo Toronto Vienna Warsaw Zurich
""".split()
WORD_SENTENCES = [
    "The {adj} {noun} is next to the {noun2}.",
    "{Name} decided to {verb} the {noun} before lunch.",
    "We need to {verb} the {adj} {noun} carefully.",
    "In {city}, the {noun} is usually {adj}.",
    "My {noun} looked {adj} after the {noun2} fell on it.",
    "Please {verb} the {noun} and then {verb2} the {noun2}.",
    "Every {period}, {Name} tries to {verb} a {adj} {noun}.",
    "The {noun} in the {noun2} was surprisingly {adj}.",
]


def cap(s: str) -> str:
    return s[:1].upper() + s[1:]


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
            adj=r.choice(ADJS), noun=noun, noun2=noun2, verb=verb, verb2=verb2,
            Name=r.choice(NAMES)[0], city=r.choice(CITIES), period=r.choice(PERIODS),
        )

    def sentence(self, topic: str) -> str:
        r = self.r
        if r.random() < 0.3:
            return self.word_sentence()
        t = r.choice(SENTENCES)
        vp, vp2 = r.sample(VERB_PHRASES, 2)
        np_, np2 = r.sample(NOUN_PHRASES, 2)
        s = t.format(
            Topic=cap(topic), topic=topic, adj=r.choice(ADJECTIVES), np=np_, np2=np2, vp=vp,
            vp2=vp2, ger=r.choice(GERUNDS), conn=r.choice(CONNECTORS), effect=r.choice(EFFECTS),
            num=r.randint(2, 5), period=r.choice(PERIODS), Name=r.choice(NAMES)[0],
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
            q = (f"{name} has {a} {item}. {He} buys {b} more and then gives {c} to {friend}. "
                 f"How many {item} does {name} have now?")
            s = (f"After buying more, {name} has {a} + {b} = {a + b} {item}.\n"
                 f"After giving {c} to {friend}, {he} has {a + b} - {c} = {a + b - c} {item}.\n"
                 f"#### {a + b - c}")
        elif kind == 1:
            good, price = r.choice(GOODS)
            n = r.randint(2, 9)
            paid = ((price * n) // 10 + 1 + r.randint(0, 3)) * 10
            q = (f"A {good} costs ${price}. {name} buys {n} of them and pays with ${paid}. "
                 f"How much change does {he} get?")
            s = (f"The total cost is {n} x ${price} = ${n * price}.\n"
                 f"The change is ${paid} - ${n * price} = ${paid - n * price}.\n#### {paid - n * price}")
        elif kind == 2:
            item = r.choice(ITEMS)
            per, boxes = r.randint(3, 12), r.randint(2, 12)
            friends = r.choice([d for d in range(2, 9) if (per * boxes) % d == 0] or [1])
            total = per * boxes
            q = (f"{name} has {boxes} boxes with {per} {item} in each box. {He} shares all the {item} "
                 f"equally among {friends} friends. How many {item} does each friend get?")
            s = (f"{name} has {boxes} x {per} = {total} {item} in total.\n"
                 f"Each friend gets {total} / {friends} = {total // friends} {item}.\n#### {total // friends}")
        elif kind == 3:
            good, price = r.choice(GOODS)
            price *= 10
            pct = r.choice([10, 20, 25, 50])
            off = price * pct // 100
            q = (f"A {good} normally costs ${price}. This week it is {pct}% off. "
                 f"How much does {name} pay for it this week?")
            s = (f"The discount is {pct}% of ${price} = ${off}.\n"
                 f"{name} pays ${price} - ${off} = ${price - off}.\n#### {price - off}")
        else:
            speed, hours, extra = r.randint(30, 90), r.randint(2, 6), r.randint(10, 80)
            q = (f"{name} drives at {speed} miles per hour for {hours} hours and then drives another "
                 f"{extra} miles to reach {his} friend {friend}. How many miles does {he} drive in total?")
            s = (f"In {hours} hours {he} drives {speed} x {hours} = {speed * hours} miles.\n"
                 f"In total {he} drives {speed * hours} + {extra} = {speed * hours + extra} miles.\n"
                 f"#### {speed * hours + extra}")
        instr = r.choice(["Solve the following math word problem step by step.",
                          "Answer the question and show your reasoning.", q])
        if instr == q:
            return q, "", s
        return instr, q, s

    def code(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        task, fname, body, call, result = r.choice(CODE_TASKS)(r)
        lang_intro = r.choice([
            "Here is a simple Python function that does this:",
            "You can solve this with a short Python function:",
            "One clear way to write it in Python:",
        ])
        code = f"```python\n{body}\n```"
        expl = self.paragraph("unit testing", r.randint(1, 2))
        example = f"Example:\n\n```python\n>>> {call}\n{result}\n```"
        out = f"{lang_intro}\n\n{code}\n\n{example}\n\n{expl}"
        if len(out) < target_chars:
            out = self.paragraphs_until(r.choice(["unit testing", "caching", "version control",
                                                  "database indexing"]), target_chars, out)
        instr = r.choice([f"Write a Python function `{fname}` that {task}.",
                          f"Implement {task} in Python.",
                          f"How do I write a function that {task}?"])
        return instr, "", out

    def tips(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        goal = r.choice(GOALS)
        n = max(3, min(10, target_chars // 150))
        instr = r.choice([f"Give me {n} tips for {goal}.", f"List {n} ways to get better at {goal}.",
                          f"What are {n} practical pieces of advice for {goal}?"])
        out = f"Here are {n} tips for {goal}:\n\n" + self.numbered_list(goal, min(n, len(VERB_PHRASES)))
        if len(out) < target_chars:
            out = self.paragraphs_until(goal, target_chars, out)
        return instr, "", out

    def explain(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        topic = r.choice(TOPICS)
        instr = r.choice([f"Explain {topic} in simple terms.", f"What should I know about {topic}?",
                          f"Write a short overview of {topic}.", f"Why does {topic} matter?"])
        return instr, "", self.paragraphs_until(topic, target_chars)

    def guide(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        topic = r.choice(TOPICS)
        instr = (f"Write a detailed guide to {topic} for beginners, with sections, examples and a "
                 f"checklist at the end.")
        head = f"# A beginner's guide to {topic}\n\n" + self.paragraph(topic)
        body = self.paragraphs_until(topic, target_chars - 400, head)
        return instr, "", body + "\n\n## Checklist\n\n" + self.numbered_list(topic, 5)

    def summarize(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        topic = r.choice(TOPICS)
        text = self.paragraphs_until(topic, max(200, int(target_chars * 0.8)))
        instr = r.choice(["Summarize the following text in two sentences.",
                          "Write a one-paragraph summary of this passage.", "TL;DR:"])
        return instr, text, self.paragraph(topic, 2)

    def words_task(self, target_chars: int) -> tuple[str, str, str]:
        r = self.r
        pick = r.random()
        if pick < 0.4:
            words = r.sample(NOUNS + VERBS + ADJS, max(4, min(60, target_chars // 16)))
            return ("Sort the following words in alphabetical order.", ", ".join(words),
                    ", ".join(sorted(words)))
        if pick < 0.7:
            word = r.choice(NOUNS)
            out = " ".join(self.word_sentence() for _ in range(r.randint(1, 3)))
            out = f"Here is a sentence with the word \"{word}\": The {r.choice(ADJS)} {word} " \
                  f"was easy to {r.choice(VERBS)}. {out}"
            return f"Use the word \"{word}\" in a sentence.", "", out
        city = r.choice(CITIES)
        n = r.randint(3, 6)
        lines = [f"- {cap(r.choice(VERBS))} the {r.choice(ADJS)} {r.choice(NOUNS)}" for _ in range(n)]
        return (f"Make a short to-do list for a weekend in {city}.", "",
                f"Weekend in {city}:\n" + "\n".join(lines))

    def short(self) -> tuple[str, str, str]:
        r = self.r
        if r.random() < 0.6:
            tmpl, label = r.choice(REVIEWS)
            return ("Classify the sentiment of this review as Positive, Negative or Neutral.",
                    tmpl.format(thing=r.choice(THINGS)), label)
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
            msgs.append({"role": "system", "content": r.choice([
                "You are a helpful assistant.",
                "You are a patient tutor. Explain things step by step.",
                "You are a concise assistant. Keep answers short and accurate.",
                "You are a friendly coding assistant who writes clear Python.",
            ])})
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
                    q = r.choice([f"Can you explain {topic}?", f"I keep hearing about {topic}. What is it?",
                                  f"How does {topic} work?"])
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
        title = r.choice([f"Notes on {topic}", f"{cap(topic)}: a short introduction",
                          f"What I learned about {topic}", f"Thinking about {topic}"])
        return {"text": self.paragraphs_until(topic, target, title)}


# ------------------------------------------------------------------------------------ code tasks


def _t_reverse(r: random.Random):
    s = r.choice(["hello", "packing", "python", "level", "stream"])
    body = "def reverse_string(s: str) -> str:\n    \"\"\"Return s reversed.\"\"\"\n    return s[::-1]"
    return "reverses a string", "reverse_string", body, f"reverse_string({s!r})", repr(s[::-1])


def _t_even_sum(r: random.Random):
    xs = [r.randint(0, 20) for _ in range(r.randint(3, 7))]
    body = ("def sum_even(numbers: list[int]) -> int:\n    total = 0\n    for n in numbers:\n"
            "        if n % 2 == 0:\n            total += n\n    return total")
    return ("returns the sum of the even numbers in a list", "sum_even", body, f"sum_even({xs})",
            str(sum(x for x in xs if x % 2 == 0)))


def _t_prime(r: random.Random):
    n = r.randint(2, 100)
    body = ("def is_prime(n: int) -> bool:\n    if n < 2:\n        return False\n    i = 2\n"
            "    while i * i <= n:\n        if n % i == 0:\n            return False\n        i += 1\n"
            "    return True")
    ok = n >= 2 and all(n % i for i in range(2, int(n ** 0.5) + 1))
    return "checks whether a number is prime", "is_prime", body, f"is_prime({n})", str(ok)


def _t_factorial(r: random.Random):
    n = r.randint(0, 12)
    body = ("def factorial(n: int) -> int:\n    result = 1\n    for k in range(2, n + 1):\n"
            "        result *= k\n    return result")
    return "computes the factorial of n", "factorial", body, f"factorial({n})", str(math.factorial(n))


def _t_fib(r: random.Random):
    n = r.randint(1, 15)
    body = ("def fibonacci(n: int) -> list[int]:\n    seq = [0, 1]\n    while len(seq) < n:\n"
            "        seq.append(seq[-1] + seq[-2])\n    return seq[:n]")
    seq = [0, 1]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    return ("returns the first n Fibonacci numbers", "fibonacci", body, f"fibonacci({n})",
            str(seq[:n]))


def _t_dedup(r: random.Random):
    xs = [r.randint(1, 6) for _ in range(r.randint(4, 9))]
    body = ("def dedupe(items: list) -> list:\n    seen = set()\n    out = []\n    for x in items:\n"
            "        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out")
    return ("removes duplicates from a list while keeping the order", "dedupe", body,
            f"dedupe({xs})", str(list(dict.fromkeys(xs))))


def _t_celsius(r: random.Random):
    c = r.randint(-20, 40)
    body = "def to_fahrenheit(celsius: float) -> float:\n    return celsius * 9 / 5 + 32"
    return ("converts Celsius to Fahrenheit", "to_fahrenheit", body, f"to_fahrenheit({c})",
            str(c * 9 / 5 + 32))


def _t_palindrome(r: random.Random):
    s = r.choice(["racecar", "level", "python", "noon", "packing", "madam"])
    body = ("def is_palindrome(text: str) -> bool:\n    cleaned = ''.join(c.lower() for c in text "
            "if c.isalnum())\n    return cleaned == cleaned[::-1]")
    return ("checks whether a string is a palindrome", "is_palindrome", body,
            f"is_palindrome({s!r})", str(s == s[::-1]))


def _t_count_words(r: random.Random):
    s = " ".join(r.choice(["the", "cat", "sat", "on", "mat", "a", "dog"]) for _ in range(6))
    body = ("def count_words(text: str) -> dict[str, int]:\n    counts = {}\n"
            "    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n"
            "    return counts")
    counts: dict[str, int] = {}
    for w in s.split():
        counts[w] = counts.get(w, 0) + 1
    return "counts how often each word appears in a text", "count_words", body, \
        f"count_words({s!r})", str(counts)


def _t_max(r: random.Random):
    xs = [r.randint(-50, 50) for _ in range(r.randint(3, 8))]
    body = ("def largest(numbers: list[int]) -> int:\n    best = numbers[0]\n    for n in numbers[1:]:\n"
            "        if n > best:\n            best = n\n    return best")
    return "finds the largest number in a list", "largest", body, f"largest({xs})", str(max(xs))


def _t_bsearch(r: random.Random):
    xs = sorted(r.sample(range(1, 60), 8))
    x = r.choice(xs + [61])
    body = ("def binary_search(items: list[int], target: int) -> int:\n    lo, hi = 0, len(items) - 1\n"
            "    while lo <= hi:\n        mid = (lo + hi) // 2\n        if items[mid] == target:\n"
            "            return mid\n        if items[mid] < target:\n            lo = mid + 1\n"
            "        else:\n            hi = mid - 1\n    return -1")
    return ("performs binary search on a sorted list", "binary_search", body,
            f"binary_search({xs}, {x})", str(xs.index(x) if x in xs else -1))


CODE_TASKS: list[Callable[[random.Random], tuple[str, str, str, str, str]]] = [
    _t_reverse, _t_even_sum, _t_prime, _t_factorial, _t_fib, _t_dedup, _t_celsius, _t_palindrome,
    _t_count_words, _t_max, _t_bsearch,
]

# ------------------------------------------------------------------------------------ writers


def instruction_targets(r: random.Random) -> list[int]:
    """Token-length targets: lognormal (median 120), clipped below the long examples, plus 3 > 8192."""
    targets = [int(min(6000, max(8, r.lognormvariate(math.log(110), 0.95))))
               for _ in range(N_INSTRUCTIONS - len(LONG_TARGETS))]
    for i, t in enumerate(LONG_TARGETS):  # spread the long ones through the file
        targets.insert((i + 1) * N_INSTRUCTIONS // (len(LONG_TARGETS) + 1), t)
    return targets


def write_jsonl(path: Path, rows: Iterator[dict]) -> None:
    """One JSON object per line, the file written whole or not at all (`benchlib.write_output`)."""
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    write_output(path, write)


def make_samples(out: Path) -> list[Path]:
    r = random.Random(SEED)
    g = Gen(r)
    targets = instruction_targets(r)
    files = [out / name for name in SAMPLE_FILES]
    write_jsonl(files[0], (g.instruction(t) for t in targets))
    write_jsonl(files[1], (g.chat() for _ in range(N_CHAT)))
    write_jsonl(files[2], (g.text() for _ in range(N_TEXT)))
    return files


def training_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                if "messages" in row:
                    yield from (m["content"] for m in row["messages"])
                else:
                    yield from (v for v in row.values() if v)


def make_tokenizer(files: list[Path], out: Path) -> list[Path]:
    """Train the byte-level BPE and write tokenizer.json + tokenizer_config.json (canonical JSON)."""
    # BPE training gave identical merges with 1, 2 and 4 rayon threads (tokenizers 0.23.3); the test
    # regenerates and compares bytes, so a version where that stops holding is caught.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Deliberately no post-processor that inserts BOS/EOS: the pipeline adds them itself.
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(training_texts(files), trainer=trainer)
    folder = out / "tokenizer"
    tok_json = json.loads(tok.to_str())
    added_decoder = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word",
                                          "special")}
        for t in tok_json["added_tokens"]
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
        "additional_special_tokens": [IM_START, IM_END],
        "extra_special_tokens": {},
        # The pipeline adds BOS/EOS explicitly; the tokenizer must not add them on its own.
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "padding_side": "right",
        "added_tokens_decoder": added_decoder,
        "chat_template": CHAT_TEMPLATE,
    }
    paths = [folder / "tokenizer.json", folder / "tokenizer_config.json"]
    # tokenizer.json keeps its key order (the vocab is written in id order); config keys are sorted.
    write_text_output(paths[0], json.dumps(tok_json, ensure_ascii=False, indent=1) + "\n", "--out")
    write_text_output(paths[1], json.dumps(config, ensure_ascii=False, indent=2, sort_keys=True) + "\n", "--out")
    return paths


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def generate(out: Path) -> dict:
    """Write everything under `out`; return the GENERATED.json record (also written)."""
    import tokenizers

    samples = make_samples(out)
    tok_files = make_tokenizer(samples, out)
    record = {
        "command": "python scripts/make_sample_data.py",
        "seed": SEED,
        "python_random": "random.Random (Mersenne Twister), stable across CPython 3.x",
        "tokenizers_version": tokenizers.__version__,
        "files": {p.relative_to(out).as_posix(): sha256(p) for p in samples + tok_files},
    }
    write_text_output(out / "GENERATED.json", json.dumps(record, indent=2, sort_keys=True) + "\n", "--out")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    default = Path(__file__).resolve().parent.parent / "data"
    ap.add_argument("--out", type=Path, default=default, help="output folder (default: data/)")
    args = ap.parse_args(argv)
    check_output_folder(args.out)
    for name in (*SAMPLE_FILES, "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "GENERATED.json"):
        check_output(args.out / name)  # each file this writes: none may be a folder or a device
    record = generate(args.out)
    for name, digest in record["files"].items():
        size = (args.out / name).stat().st_size
        print(f"{name:32s} {size:>9,d} bytes  sha256 {digest[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
