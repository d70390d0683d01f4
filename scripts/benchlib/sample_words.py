"""The vocabularies of the embedded sample data (scripts/tools/make_sample_data.py): names, goods,
topics, sentence pieces and word lists, in a fixed order (the generated files depend on it)."""

from __future__ import annotations

NAMES = [
    ("Maria", "she"),
    ("James", "he"),
    ("Aisha", "she"),
    ("Chen", "he"),
    ("Olivia", "she"),
    ("Kofi", "he"),
    ("Lucas", "he"),
    ("Priya", "she"),
    ("Sofia", "she"),
    ("Mateo", "he"),
    ("Hannah", "she"),
    ("Yuki", "she"),
    ("Omar", "he"),
    ("Elena", "she"),
    ("Noah", "he"),
    ("Fatima", "she"),
    ("Liam", "he"),
    ("Grace", "she"),
    ("Ravi", "he"),
    ("Zoe", "she"),
    ("Daniel", "he"),
    ("Amara", "she"),
    ("Tom", "he"),
    ("Lena", "she"),
    ("Ibrahim", "he"),
]
ITEMS = [
    "apples",
    "pencils",
    "books",
    "marbles",
    "stickers",
    "cookies",
    "tickets",
    "coins",
    "seeds",
    "cards",
    "oranges",
    "cupcakes",
    "notebooks",
    "shells",
    "stamps",
    "balloons",
    "eggs",
    "flowers",
]
GOODS = [
    ("notebook", 3),
    ("sandwich", 6),
    ("movie ticket", 12),
    ("plant", 8),
    ("pair of socks", 5),
    ("bag of rice", 14),
    ("bottle of juice", 2),
    ("book", 15),
    ("board game", 25),
    ("scarf", 18),
]
TOPICS = [
    "photosynthesis",
    "the water cycle",
    "compound interest",
    "version control",
    "binary search",
    "climate change",
    "healthy sleep",
    "a balanced diet",
    "public speaking",
    "time management",
    "recycling",
    "volcanoes",
    "the immune system",
    "machine learning",
    "unit testing",
    "personal budgeting",
    "vegetable gardening",
    "remote work",
    "renewable energy",
    "memory",
    "the solar system",
    "supply and demand",
    "database indexing",
    "caching",
    "team meetings",
    "learning a new language",
    "electric cars",
    "bird migration",
    "ocean tides",
    "password security",
]
GOALS = [
    "studying for an exam",
    "saving money",
    "staying focused",
    "writing clean code",
    "running a small business",
    "learning to cook",
    "training for a 10k run",
    "reducing stress",
    "organizing a home office",
    "preparing for a job interview",
    "reading more books",
    "keeping a garden healthy",
    "working in a remote team",
    "debugging a program",
    "giving better feedback",
    "planning a trip",
    "sleeping better",
    "taking useful notes",
]
VERB_PHRASES = [
    "review your notes",
    "set a clear goal",
    "measure the results",
    "write down the steps",
    "ask for feedback",
    "break the task into smaller parts",
    "compare several options",
    "check your assumptions",
    "keep a simple log",
    "test one change at a time",
    "plan the week ahead",
    "remove distractions",
    "start with the hardest part",
    "take short breaks",
    "explain the idea to someone else",
    "read the documentation",
    "track your progress",
    "set a realistic deadline",
    "focus on one thing at a time",
    "look at the data before deciding",
    "keep the first version simple",
    "ask a clear question",
]
GERUNDS = [
    "understanding the problem",
    "reading the instructions",
    "checking the data",
    "planning the budget",
    "talking to the team",
    "setting up the tools",
    "writing a short outline",
    "measuring the baseline",
    "looking at earlier examples",
    "agreeing on the goal",
]
NOUN_PHRASES = [
    "a clear plan",
    "small daily habits",
    "the quality of the input",
    "careful measurement",
    "regular practice",
    "the available time",
    "good communication",
    "the size of the team",
    "the cost of materials",
    "a steady routine",
    "the amount of sunlight",
    "the choice of tools",
    "a good night of sleep",
    "simple checklists",
    "the weather",
    "early feedback",
    "the order of the steps",
    "the temperature",
    "clear naming",
    "the number of users",
    "a quiet place to work",
    "honest estimates",
    "the local climate",
    "a written summary",
]
EFFECTS = ["improve", "reduce", "change", "slow down", "speed up", "simplify", "shape", "limit"]
ADJECTIVES = [
    "important",
    "useful",
    "simple",
    "common",
    "surprising",
    "practical",
    "reliable",
    "flexible",
    "difficult",
    "helpful",
    "effective",
    "popular",
]
PERIODS = ["day", "week", "month"]
CONNECTORS = [
    "In practice,",
    "For example,",
    "However,",
    "As a result,",
    "In many cases,",
    "Over time,",
    "At the same time,",
    "In short,",
    "On the other hand,",
    "Most of the time,",
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
