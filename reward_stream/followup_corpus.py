"""The labelled follow-up corpus the dissatisfaction classifier is trained and scored on.

``python -m rtrl.reward_stream.followup_corpus`` rewrites ``reward_stream/data/followups.jsonl``
from the templates below with a fixed seed; the committed file is what training reads,
so regenerating is only needed after editing the templates.

Label 1: the user is unhappy with the edit just shown (complaints, corrections however
polite, sarcasm, pasted errors). Label 0: neutral or positive (thanks, the next request,
questions about the code, "looks good, also ...").

The held-out split is by *template*, not by message: every variant of a template lands
on the same side, so the held-out score measures phrasings the head never saw.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

CORPUS_PATH = Path(__file__).parent / "data" / "followups.jsonl"
SEED = 20261123
VARIANTS_PER_TEMPLATE = 7
HELDOUT_BUCKETS = 4  # one template in four is held out

# Slot fillers. (wanted, what the edit did) pairs feed the correction templates.
NAMES = (
    "parse_config",
    "load_user",
    "retry",
    "main",
    "handle_request",
    "to_json",
    "UserService",
    "fetch_rows",
    "validate_email",
    "tokenize",
    "run_migrations",
    "render",
    "is_admin",
    "compute_total",
    "Cache",
    "get_db",
    "send_invoice",
    "normalize_path",
    "on_click",
    "useAuth",
)
THINGS = (
    "the logging",
    "my comments",
    "the docstring",
    "the error handling",
    "the type hints",
    "the tests",
    "the retry loop",
    "the imports",
    "the config parsing",
    "the null check",
    "the license header",
    "the TODO",
    "the early return",
    "the lock",
    "the cache",
)
STYLES = (
    ("tabs", "spaces"),
    ("spaces", "tabs"),
    ("single quotes", "double quotes"),
    ("double quotes", "single quotes"),
    ("f-strings", ".format()"),
    ("pathlib", "os.path"),
    ("snake_case", "camelCase"),
    ("4-space indent", "2-space indent"),
    ("2 spaces", "4 spaces"),
    ("a for loop", "a list comprehension"),
    ("a dataclass", "a plain dict"),
    ("pytest", "unittest"),
    ("early returns", "nested ifs"),
    ("const", "let"),
    ("async/await", "callbacks"),
    ("the logger", "print statements"),
    ("httpx", "requests"),
)
ERRORS = (
    "NameError: name 'os' is not defined",
    "SyntaxError: invalid syntax",
    "ImportError: cannot import name 'Config'",
    "IndentationError: unexpected indent",
    "TypeError: 'NoneType' object is not subscriptable",
    "KeyError: 'id'",
    "AttributeError: 'dict' object has no attribute 'iteritems'",
    "AssertionError: 3 != 4",
    "ModuleNotFoundError: No module named 'yaml'",
    "error[E0382]: borrow of moved value: `buf`",
    "TypeError: undefined is not a function",
    "Segmentation fault (core dumped)",
    "mypy: Incompatible return value type",
    "E501 line too long (121 > 100 characters)",
    "RecursionError: maximum recursion depth exceeded",
)

# family -> templates. Slots: {name} {other} {thing} {alt} (wanted) {orig} (what the edit did) {err}.
DISSATISFIED = {
    "blunt": (
        "no, that broke the build",
        "this is wrong",
        "wrong. try again",
        "that's completely broken",
        "you broke {name}",
        "{name} is broken now",
        "nope, {name} still returns None",
        "this doesn't even compile",
        "doesn't work",
        "it's worse than before",
        "this is garbage",
        "terrible, revert it",
        "what is this mess",
        "absolutely not what I wanted",
        "you made it worse",
        "that's nonsense, {name} never takes a list",
        "no no no",
        "this is not even close",
        "just undo all of that",
        "bad edit, roll it back",
        "the build is red now",
        "everything is failing after your change",
        "nah this is wrong",
        "you deleted half of {name}",
        "this breaks {other}",
        "wtf",
        "ugh. no.",
    ),
    "polite_correction": (
        "could you use {alt} instead?",
        "can you switch it to {alt}?",
        "I'd prefer {alt} here",
        "please keep {alt}, we don't use {orig} in this repo",
        "actually I wanted {alt}",
        "hmm, could we stick with {alt}?",
        "sorry, I meant {other}, not {name}",
        "close, but please don't rename {name}",
        "almost, but you forgot the None case",
        "thanks, but this should use {alt}",
        "nice try but the loop is off by one",
        "I think you misunderstood, I wanted {name} to stay sync",
        "can you put {thing} back?",
        "please don't touch {thing}",
        "this isn't quite what I had in mind",
        "hmm not quite, {name} should return a list",
        "could you not reformat the whole file?",
        "mind restoring {thing}? I still need it",
        "we use {alt} here, not {orig}",
        "let's go back to how it was before",
        "I asked for {alt}, not {orig}",
        "please only change {name}, leave the rest alone",
        "can you redo this without {orig}?",
        "that's not how we do it here, use {alt}",
        "I don't think that's right, {name} is called twice now",
    ),
    "sarcasm": (
        "great, now nothing compiles",
        "wow, thanks for deleting my tests",
        "oh perfect, another syntax error",
        "love how you ignored what I said",
        "amazing, you renamed everything for no reason",
        "sure, because {orig} was definitely what I asked for",
        "brilliant, {name} now loops forever",
        "cool cool, so the tests are just gone?",
        "thanks for nothing",
        "very helpful, it crashes on startup now",
        "nice, you reinvented a bug I fixed last week",
        "oh great, {thing} disappeared again",
        "fantastic, three new warnings",
        "10/10 would break prod again",
        "yeah that's totally going to work lol",
    ),
    "pasted_error": (
        "{err}",
        "still getting {err}",
        "now I get {err}",
        "tests fail: {err}",
        "ran it: {err}",
        "{err}\n\nafter your change",
        "CI says {err}",
        "same error as before: {err}",
        "it crashes with {err} when I call {name}",
        "{name} throws {err}",
    ),
    "questioning": (
        "why did you remove {thing}?",
        "where did {thing} go?",
        "what happened to {thing}?",
        "did you even run this?",
        "why is {name} calling {other} now??",
        "who asked you to touch {other}?",
        "why would you change the indentation?",
        "why are there two copies of {name} now?",
        "did you really just delete {thing}?",
        "how is this supposed to work if {other} is gone?",
        "what's with all the extra changes?",
        "seriously? {orig}?",
    ),
    "repeat_and_frustration": (
        "I told you already, use {alt}",
        "again wrong, this is the third time",
        "same mistake again",
        "I said {alt}",
        "how many times do I have to say it, no {orig}",
        "you keep doing this",
        "stop changing {thing}",
        "still broken",
        "still not fixed",
        "still fails the same way",
        "this is the same as your last answer",
        "you did it again with {orig}",
        "I wanted {alt}, not {orig}",
        "seems off, {name} returns early now",
        "hm, I don't like this",
    ),
    "typos": (
        "thats not wat i asked",
        "u broke it",
        "dosent work",
        "wrnog again",
        "nop that brok {name}",
        "ths is worse",
        "why did u delete {thing}",
        "not wht i ment",
        "plz undo",
        "broke teh tests",
        "use {alt} i said",
        "its still brokn",
    ),
    "non_english": (
        "non, c'est faux",
        "nein, das ist falsch",
        "no funciona",
        "está mal, deshazlo",
        "das ist nicht was ich wollte",
        "ça marche pas",
        "não funcionou",
        "è sbagliato",
        "niet goed, terug zetten",
        "bu yanlış",
        "dit klopt niet",
        "c'est cassé maintenant",
        "tienes que usar {alt}",
        "nein, bitte {alt}",
        "ça compile plus",
    ),
}

NEUTRAL = {
    "thanks": (
        "thanks!",
        "perfect, thank you",
        "great work",
        "lgtm",
        "ty",
        "awesome",
        "nice, that works",
        "works now, thanks",
        "exactly what I needed",
        "cool",
        "thank you so much",
        "👍",
        "ok",
        "that fixed it",
        "beautiful",
        "sweet, tests pass",
        "good catch",
        "much cleaner, thanks",
        "perfect",
        "yes, that's it",
        "oh nice, didn't know about that",
        "🙏 thanks",
    ),
    "next_request": (
        "now add tests for {name}",
        "next, do the same for {other}",
        "can you also add a docstring to {name}?",
        "add type hints to {name}",
        "now write the README section",
        "ok now hook {name} into {other}",
        "now make {name} async",
        "next: handle the empty input case in {other}",
        "add logging to {name} too",
        "now the same for the CLI",
        "can you write a migration for this?",
        "let's move on to {other}",
        "now refactor {other} the same way",
        "generate a changelog entry",
        "add a unit test for the error path",
        "can you add a --dry-run flag?",
        "now expose {name} over the API",
        "write the integration test next",
        "please also update the docs",
        "wire {name} into the settings page",
        "next task: paginate {other}",
        "add caching to {name}",
        "now let's do {other}",
        "can you benchmark {name}?",
        "rename {name} to {other}",
        "extract the parsing out of {name} into a helper",
        "make {name} a method on {other}",
        "split {name} into two functions",
        "inline {other}",
        "move {name} to utils",
        "add a retry around {other}",
        "delete the old {other}, it's unused",
        "switch {other} to {alt} as well",
        "make the variable names in {name} clearer",
    ),
    "approval_plus": (
        "looks good, also rename {name} to {other}",
        "nice. also add logging to {name}",
        "great, and can you export {name} from the package?",
        "good, now also handle timeouts in {other}",
        "perfect, one more thing: add {thing} to {other}",
        "ok that works, also bump the version",
        "lgtm, can you squash this into one commit?",
        "works! now do the same for {other}",
        "thanks, also add {name} to __all__",
        "cool, and a test for it please",
        "that's right, now make {other} use it",
        "yep, also sort the imports while you're there",
    ),
    "question": (
        "how does {name} handle empty input?",
        "what's the complexity of this?",
        "why is {name} async?",
        "is {name} thread safe?",
        "what does {other} return on error?",
        "can you explain the regex?",
        "where is {name} called from?",
        "does this work on windows?",
        "which python version do we need for this?",
        "what would a test for {name} look like?",
        "is there a faster way to do this?",
        "should {name} live in its own module?",
        "why {alt} rather than {orig}? just curious",
        "how would I call {name} from the CLI?",
        "what's the difference between {name} and {other}?",
    ),
    "negation_but_fine": (
        "no worries, thanks",
        "now it works, thanks",
        "no problem, next file",
        "don't forget to update the README too",
        "write a test that checks it doesn't crash on empty input",
        "add an undo button to the editor",
        "can you stop the server on exit too?",
        "make sure {name} doesn't log passwords",
        "no rush, but can you also look at {other}?",
        "nothing broke, nice",
        "no more warnings, great",
        "the wrong-password path needs a test too",
        "add a check that {name} is not None",
        "not bad at all",
        "no complaints, ship it",
        "I know, now do {other}",
        "undo/redo should also go through {name}",
        "no worries, that works",
        "no issues on my side, thanks",
        "nope, nothing else for now, thanks",
        "no, that's all, good job",
        "no errors this time, nice",
        "the old version was wrong, this one is right",
    ),
    "context_and_chat": (
        "I'm going to run the tests, one sec",
        "brb",
        "let me check with the team",
        "for context, {name} is called from a cron job",
        "fyi we deploy on fridays",
        "I'll review it after lunch",
        "hmm interesting",
        "ok let me try that",
        "running it now",
        "pushing this",
        "merged",
        "we use {alt} everywhere, so that's consistent",
        "committing",
    ),
    "typos": (
        "thx",
        "looks gud",
        "nice one, now the tests pls",
        "gr8 thanks",
        "kool, nxt one",
        "add tets for {name}",
        "lgmt",
        "perfct",
        "ok now do {other} plz",
        "works tnx",
    ),
    "non_english": (
        "merci",
        "danke, passt",
        "perfecto, gracias",
        "genial",
        "super, merci beaucoup",
        "ok, jetzt bitte die Tests",
        "top, maintenant {other}",
        "obrigado",
        "grazie, perfetto",
        "ahora añade los tests",
        "prima, dankjewel",
        "teşekkürler",
        "parfait",
    ),
}


@dataclass(frozen=True)
class FollowUp:
    """One labelled follow-up message (a line of followups.jsonl)."""

    message: str
    label: int
    """1 = dissatisfied with the edit just shown, 0 = neutral or positive."""
    template: str
    """``label/family/index``: every variant of one template shares it and its split."""
    split: str
    """``train`` or ``heldout``, a function of ``template`` alone (see heldout_template)."""


def heldout_template(template: str) -> bool:
    """Stable across processes and Python versions (unlike ``hash``)."""
    return int(hashlib.sha256(template.encode()).hexdigest(), 16) % HELDOUT_BUCKETS == 0


def _fill(template: str, rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    alt, orig = rng.choice(STYLES)
    return template.format(
        name=name, other=other, thing=rng.choice(THINGS), alt=alt, orig=orig, err=rng.choice(ERRORS)
    )


def _typo(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    long_words = [i for i, w in enumerate(words) if len(w) > 4 and w.isalpha()]
    if not long_words:
        return text
    i = rng.choice(long_words)
    j = rng.randrange(len(words[i]) - 1)
    w = words[i]
    words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def _surface(text: str, rng: random.Random) -> str:
    """Noise real chat has: case, trailing punctuation, typos, a dangling 'pls'."""
    if rng.random() < 0.3:
        text = text.lower()
    if rng.random() < 0.25:
        text = text.rstrip(".!?")
    if rng.random() < 0.15:
        text = _typo(text, rng)
    if rng.random() < 0.08 and "pl" not in text:
        text = text + rng.choice((" pls", " please", " thx"))
    return text


def generate(seed: int = SEED) -> list[FollowUp]:
    rng = random.Random(seed)
    seen: set[str] = set()
    corpus = []
    for label, families in ((1, DISSATISFIED), (0, NEUTRAL)):
        for family, templates in families.items():
            for index, template in enumerate(templates):
                template_id = f"{label}/{family}/{index}"
                split = "heldout" if heldout_template(template_id) else "train"
                for variant in range(VARIANTS_PER_TEMPLATE):
                    text = _fill(template, rng)
                    message = text if variant == 0 else _surface(text, rng)
                    if message.strip().lower() in seen:
                        continue
                    seen.add(message.strip().lower())
                    corpus.append(FollowUp(message, label, template_id, split))
    return corpus


def load(path: Path = CORPUS_PATH) -> list[FollowUp]:
    return [FollowUp(**json.loads(line)) for line in path.read_text().splitlines() if line]


def corpus_sha256(path: Path = CORPUS_PATH) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    corpus = generate()
    CORPUS_PATH.parent.mkdir(exist_ok=True)
    CORPUS_PATH.write_text(
        "".join(json.dumps(asdict(f), ensure_ascii=False) + "\n" for f in corpus)
    )
    heldout = sum(f.split == "heldout" for f in corpus)
    print(f"wrote {len(corpus)} follow-ups ({heldout} held out) to {CORPUS_PATH}")


if __name__ == "__main__":
    main()
