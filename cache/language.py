"""Language and script: a hard check beside the verifier, whose embedder is multilingual enough
to match "Quelle est la capitale de la France?" with "What is the capital of France?" (0.77)
and whose WordNet is English only, so a French or Spanish question looks like a few unknown
words around a shared name. A user who asks in French wants the answer in French.

Two cheap signs, no model:

* **script**: the script of most letters (Latin, Cyrillic, Greek, Arabic, Hebrew, Devanagari,
  Thai, Hangul, kana, Han), read from each letter's Unicode name; two texts whose main scripts
  differ are refused (a question in Chinese / "What is the capital of France?");
* **language** among the Latin-script ones: the share of words in a short list of each
  language's most frequent function words (articles, prepositions, pronouns, auxiliaries:
  English, French, Spanish, Portuguese, Italian, German, Dutch), outside quotation marks. A
  text has a language when at least ``MIN_HITS`` of its words are in that list and at least
  ``MARGIN`` times as many as in any other list; two texts with a language each, and not the
  same one, are refused. A short or mixed text has none and is never refused on language
  ("Translate 'bonjour' into English" keeps its English).

The check can only turn hits into misses.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from functools import lru_cache

MIN_HITS = 2
MARGIN = 1.5


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_FUNCTION_WORDS: dict[str, frozenset[str]] = {
    "en": _words(
        "the a an of to in is are was were be been do does did what which who how why when "
        "where can could should would will i you he she it we they my your this that these "
        "those with for from on and or but not have has"
    ),
    "fr": _words(
        "le la les un une des du de au aux est sont et ou mais que qui quoi quel quelle quels "
        "quelles comment pourquoi où je tu il elle nous vous ils elles mon ma mes ton ta ce "
        "cette ces dans sur pour avec sans pas ne être avoir fait qu ce y en"
    ),
    "es": _words(
        "el la los las un una unos unas de del al es son está están y o pero que qué quién "
        "cuál cuáles cómo por para porque dónde cuándo yo tú él ella nosotros ellos mi mis tu "
        "su sus este esta estos estas con sin no en se lo le hay ser"
    ),
    "pt": _words(
        "o a os as um uma uns umas de do da dos das no na nos nas ao é são está estão e ou "
        "mas que qual quais quem como por para porque onde quando eu você ele ela nós eles meu "
        "minha seu sua este esta isso com sem não em se há ser"
    ),
    "it": _words(
        "il lo la i gli le un uno una di del della dei delle al alla è sono e o ma che chi "
        "quale quali come perché dove quando io tu lui lei noi voi loro mio mia suo sua questo "
        "questa con senza non in si per"
    ),
    "de": _words(
        "der die das den dem des ein eine einen einem einer ist sind war und oder aber was "
        "wer wie warum wo wann welche welcher welches ich du er sie es wir ihr mein meine "
        "dein sein ihre dieser diese dieses mit ohne nicht kein keine in im auf für von zu "
        "zum zur bei hat haben"
    ),
    "nl": _words(
        "de het een van en of maar is zijn was wat wie hoe waarom waar wanneer welke ik jij "
        "hij zij wij jullie mijn jouw zijn haar deze dit die met zonder niet geen in op voor "
        "naar bij heeft hebben"
    ),
}
_WORD = re.compile(r"[^\W\d_]+")  # "qu'est-ce" is "qu", "est", "ce"
_QUOTED = re.compile(r"\"[^\"]*\"|\u201c[^\u201d]*\u201d|'[^']*'|\u2018[^\u2019]*\u2019")
_SCRIPTS = (
    "LATIN",
    "CYRILLIC",
    "GREEK",
    "ARABIC",
    "HEBREW",
    "DEVANAGARI",
    "THAI",
    "HANGUL",
    "HIRAGANA",
    "KATAKANA",
    "CJK",
)


def _script(char: str) -> str:
    name = unicodedata.name(char, "")
    return next((s for s in _SCRIPTS if name.startswith(s)), "OTHER")


@lru_cache(maxsize=1024)  # a stored text is compared with every question near it
def main_script(text: str) -> str | None:
    """The script of most of the text's letters; None without letters."""
    counts = Counter(_script(c) for c in text if c.isalpha())
    if not counts:
        return None
    return counts.most_common(1)[0][0]


@lru_cache(maxsize=1024)
def language(text: str) -> str | None:
    """The language whose function words the text uses clearly most; None when unclear."""
    words = [w.lower() for w in _WORD.findall(_QUOTED.sub(" ", text))]
    hits = sorted(
        ((sum(w in vocab for w in words), lang) for lang, vocab in _FUNCTION_WORDS.items()),
        reverse=True,
    )
    (best, lang), (second, _) = hits[0], hits[1]
    if best >= MIN_HITS and best >= MARGIN * second:
        return lang
    return None


def same_language(a: str, b: str) -> bool:
    """False when the two texts are written in different scripts or, both in Latin letters,
    clearly in different languages (see the module's docstring)."""
    script_a, script_b = main_script(a), main_script(b)
    if script_a is not None and script_b is not None and script_a != script_b:
        return False
    lang_a, lang_b = language(a), language(b)
    return lang_a is None or lang_b is None or lang_a == lang_b
