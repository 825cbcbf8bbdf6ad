"""Generate saffu's embedded default corpus: synthetic child-directed speech and stories.

The text comes from a small seeded probabilistic grammar written for this project (no
third-party text), with the structure language models feed on: subject–verb agreement,
determiner–noun agreement, adjective order, transitive and intransitive verbs, questions and
short dialogues. It is laid out like BabyLM (``train_10M/*.train``, ``dev/*.dev``) so every
command that runs on it runs unchanged on the real corpus.

    python data/generate_default_corpus.py            # rewrites data/default_corpus
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

NOUNS = {  # singular -> plural
    "dog": "dogs", "cat": "cats", "bird": "birds", "ball": "balls", "boy": "boys",
    "girl": "girls", "fox": "foxes", "box": "boxes", "child": "children", "mouse": "mice",
    "tree": "trees", "duck": "ducks", "horse": "horses", "book": "books", "cup": "cups",
    "teacher": "teachers", "baby": "babies", "rabbit": "rabbits", "bear": "bears",
    "friend": "friends", "apple": "apples", "truck": "trucks", "frog": "frogs",
}
ANIMATE = ["dog", "cat", "bird", "boy", "girl", "fox", "child", "mouse", "duck", "horse",
           "teacher", "baby", "rabbit", "bear", "friend", "frog"]
THINGS = ["ball", "box", "tree", "book", "cup", "apple", "truck"]
ADJECTIVES = ["big", "little", "red", "happy", "sleepy", "old", "new", "funny", "brown",
              "tiny", "blue", "soft", "hungry"]
INTRANSITIVE = {"run": "runs", "sleep": "sleeps", "jump": "jumps", "sing": "sings",
                "laugh": "laughs", "cry": "cries", "play": "plays", "swim": "swims"}
TRANSITIVE = {"see": "sees", "like": "likes", "want": "wants", "find": "finds",
              "push": "pushes", "hold": "holds", "eat": "eats", "chase": "chases"}
PAST = {"run": "ran", "sleep": "slept", "jump": "jumped", "sing": "sang", "laugh": "laughed",
        "cry": "cried", "play": "played", "swim": "swam", "see": "saw", "like": "liked",
        "want": "wanted", "find": "found", "push": "pushed", "hold": "held", "eat": "ate",
        "chase": "chased"}
PLACES = ["in the garden", "by the river", "at home", "in the park", "under the tree",
          "on the hill", "at school", "in the kitchen"]
NAMES = ["Mia", "Sam", "Leo", "Ava", "Noah", "Lily", "Max", "Ella"]
CALLS = ["look", "oh", "yes", "no", "okay", "wow", "come here", "good job"]


def noun_phrase(rng: random.Random, plural: bool, pool: list[str]) -> str:
    noun = rng.choice(pool)
    word = NOUNS[noun] if plural else noun
    det = rng.choice(["the", "some", "two", "many"] if plural else ["the", "a", "this", "my"])
    if det == "a" and rng.random() < 0.5:
        adjective = rng.choice(ADJECTIVES)
        det = "an" if adjective[0] in "aeiou" else "a"
        return f"{det} {adjective} {word}"
    if rng.random() < 0.4:
        return f"{det} {rng.choice(ADJECTIVES)} {word}"
    return f"{det} {word}"


def clause(rng: random.Random, tense: str) -> str:
    plural = rng.random() < 0.35
    subject = noun_phrase(rng, plural, ANIMATE) if rng.random() < 0.8 else rng.choice(NAMES)
    if subject in NAMES:
        plural = False
    transitive = rng.random() < 0.55
    verbs = TRANSITIVE if transitive else INTRANSITIVE
    base = rng.choice(list(verbs))
    verb = PAST[base] if tense == "past" else (base if plural else verbs[base])
    out = f"{subject} {verb}"
    if transitive:
        out += " " + noun_phrase(rng, rng.random() < 0.3, THINGS + ANIMATE)
    if rng.random() < 0.3:
        out += " " + rng.choice(PLACES)
    return out


def speech_line(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.25:
        plural = rng.random() < 0.3
        be = "are" if plural else "is"
        return f"where {be} {noun_phrase(rng, plural, ANIMATE + THINGS)} ?"
    if kind < 0.4:
        return f"do you want {noun_phrase(rng, rng.random() < 0.3, THINGS)} ?"
    if kind < 0.55:
        return f"{rng.choice(CALLS)} , {clause(rng, 'present')} ."
    if kind < 0.65:
        return rng.choice(CALLS) + " ."
    return clause(rng, "present") + " ."


def story_line(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    sentences = [f"Once upon a time there was {noun_phrase(rng, False, ANIMATE)} called {name}."]
    for _ in range(rng.randint(2, 6)):
        text = clause(rng, "past")
        if rng.random() < 0.3:
            text += " because " + clause(rng, "past")
        elif rng.random() < 0.2:
            text = f"\u201c{clause(rng, 'present').capitalize()}!\u201d said {name}"
        sentences.append(text[0].upper() + text[1:] + ".")
    sentences.append(f"Then {name} went home and slept.")
    return " ".join(sentences)


def generate(out: Path, seed: int = 2026, train_lines: int = 24_000, dev_lines: int = 4_000) -> None:
    """Write ``out/train_10M/{speech,stories}.train`` and ``out/dev/{speech,stories}.dev``."""
    rng = random.Random(seed)
    for split, suffix, lines in (("train_10M", "train", train_lines), ("dev", "dev", dev_lines)):
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        speech = [speech_line(rng) for _ in range(lines)]
        stories = [story_line(rng) for _ in range(lines // 8)]
        (folder / f"speech.{suffix}").write_text("\n".join(speech) + "\n", encoding="utf-8")
        (folder / f"stories.{suffix}").write_text("\n".join(stories) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "default_corpus")
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()
    generate(args.out, args.seed)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
