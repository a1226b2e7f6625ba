"""The built-in data sets, made by zerorun offline: an English-like LM corpus and a labelled review set."""
from __future__ import annotations

import random
from typing import List, Tuple

from ..config import DataError, TaskName

# --------------------------------------------------------------------------------------------
# The synthetic corpus: English-like text with learnable structure (agreement, arithmetic,
# repeated entities), so a tiny model's loss falls well below the unigram entropy.

_NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Radia", "Ken",
          "Margaret", "Dennis", "Leslie", "Tony", "Niklaus", "Shafi", "Robin", "Judea", "Yann", "Fei"]
_PLACES = ["the lab", "the library", "the garden", "the harbour", "the station", "the market",
           "the museum", "the river", "the forest", "the workshop", "the old mill", "the bridge"]
_OBJECTS = ["a book", "a lamp", "a map", "a violin", "a kettle", "a compass", "a notebook", "a clock",
            "a telescope", "a basket", "a key", "a letter", "a bicycle", "a kite", "a ladder"]
_VERBS = [("finds", "found"), ("carries", "carried"), ("repairs", "repaired"), ("paints", "painted"),
          ("sells", "sold"), ("borrows", "borrowed"), ("hides", "hid"), ("opens", "opened")]
_TIMES = ["in the morning", "at noon", "in the evening", "at night", "on Monday", "on Friday"]
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
            "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]


def _sentence(rng: random.Random, who: str) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        present, _ = rng.choice(_VERBS)
        return f"{who} {present} {rng.choice(_OBJECTS)} at {rng.choice(_PLACES)} {rng.choice(_TIMES)}."
    if kind == 1:
        _, past = rng.choice(_VERBS)
        return f"Yesterday {who} {past} {rng.choice(_OBJECTS)} near {rng.choice(_PLACES)}."
    if kind == 2:
        a, b = rng.randrange(10), rng.randrange(9)
        return f"{who} says that {_NUMBERS[a]} plus {_NUMBERS[b]} is {_NUMBERS[a + b]}."
    if kind == 3:
        n = rng.randrange(2, 10)
        return f"There are {_NUMBERS[n]} people at {rng.choice(_PLACES)}, and {who} counts {_NUMBERS[n]} of them."
    other = rng.choice(_NAMES)
    return f"{who} meets {other} at {rng.choice(_PLACES)}, and {other} greets {who}."


def synthetic_corpus(n_docs: int, seed: int) -> List[str]:
    """``n_docs`` short documents, each about one person, deterministic in ``seed``."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        who = rng.choice(_NAMES)
        docs.append(" ".join(_sentence(rng, who) for _ in range(rng.randrange(3, 9))))
    return docs


# The sentiment set: reviews labelled 1 (positive) / 0 (negative). Validation reviews use only
# adjectives held out of training, so scoring above chance needs prior knowledge of English.

_POSITIVE = ["good", "great", "excellent", "wonderful", "fantastic", "amazing", "superb", "delightful", "brilliant",
             "lovely", "outstanding", "marvelous", "terrific", "enjoyable", "pleasant", "charming", "beautiful",
             "perfect", "impressive", "fabulous", "splendid", "magnificent", "stunning", "remarkable", "exceptional",
             "awesome", "glorious", "joyful", "uplifting", "heartwarming", "exquisite", "phenomenal", "admirable",
             "satisfying", "refreshing", "captivating", "engaging", "inspiring", "masterful", "gorgeous"]
_NEGATIVE = ["bad", "terrible", "awful", "horrible", "dreadful", "poor", "boring", "dull", "disappointing",
             "mediocre", "weak", "annoying", "painful", "tedious", "unpleasant", "ugly", "lousy", "pathetic",
             "miserable", "atrocious", "abysmal", "frustrating", "bland", "clumsy", "sloppy", "lifeless", "tiresome",
             "forgettable", "dismal", "shoddy", "grim", "wretched", "subpar", "insulting", "unbearable", "disastrous",
             "messy", "confusing", "hollow", "dreary"]
_ITEMS = ["movie", "film", "plot", "acting", "soundtrack", "ending", "dialogue", "cast", "script", "book", "meal",
          "service", "hotel", "room", "concert", "show", "album", "game", "story", "performance"]
_TEMPLATES = ["The {item} was {adj}.", "I thought the {item} was {adj}.", "What a {adj} {item}!",
              "Honestly, the {item} felt {adj} to me.", "Everyone agreed the {item} was {adj}.",
              "The {item} is {adj}, and I would say so again.", "My friend called the {item} {adj}."]
_HELD_OUT = 10  # adjectives per class seen only in validation


def sentiment_dataset(n_train: int, seed: int) -> Tuple[List[Tuple[str, int]], List[Tuple[str, int]]]:
    """(train, validation) lists of (review, label); validation has n_train // 4 reviews."""
    rng = random.Random(seed)

    def make(n: int, pos: List[str], neg: List[str]) -> List[Tuple[str, int]]:
        rows = []
        for i in range(n):
            label = i % 2
            adj = rng.choice(pos if label else neg)
            rows.append((rng.choice(_TEMPLATES).format(item=rng.choice(_ITEMS), adj=adj), label))
        rng.shuffle(rows)
        return rows

    train = make(n_train, _POSITIVE[:-_HELD_OUT], _NEGATIVE[:-_HELD_OUT])
    val = make(max(2, n_train // 4), _POSITIVE[-_HELD_OUT:], _NEGATIVE[-_HELD_OUT:])
    return train, val



BUILTIN = ("synthetic", "sentiment")


def builtin_rows(name: str, task: TaskName, num_labels: int, n_docs: int, seed: int):
    """(train, val or None, label names) of a built-in set for ``task``; DataError when they do not fit."""
    if name not in BUILTIN:
        raise DataError(f"data.name={name}: no such built-in data set and no data.path.",
                        "data.path=<your file>, or data.name=synthetic|sentiment.", key="data.name", value=name)
    if TaskName(task) == TaskName.causal_lm:
        if name != "synthetic":
            from ..arch import families

            raise DataError("data=sentiment is a classification set.", "task=sequence_classification with a model "
                            f"of an encoder family ({', '.join(families(decoder=False))}), or data=synthetic.",
                            key="data.name", value=name)
        return synthetic_corpus(n_docs, seed), None, []
    if name != "sentiment":
        raise DataError("data=synthetic has no labels.", "data=sentiment, or data.path=<labelled jsonl/csv>.",
                        key="data.name", value=name)
    if num_labels != 2:
        raise DataError(f"data=sentiment has 2 labels but task.num_labels={num_labels}.", "task.num_labels=2.",
                        key="task.num_labels", value=num_labels)
    train, val = sentiment_dataset(n_docs, seed)
    return train, val, ["negative", "positive"]
