"""Word tables of the perturbations (``cache.training.perturb``): closed-class swaps that
change a question's meaning, contractions, politeness frames and restricting modifiers."""

from __future__ import annotations

SWAP_RELATIONS = {
    "to": "from",
    "from": "to",
    "before": "after",
    "after": "before",
    "above": "below",
    "below": "above",
    "over": "under",
    "under": "over",
    "with": "without",
    "without": "with",
    "up": "down",
    "down": "up",
    "inside": "outside",
    "outside": "inside",
}
QUANTIFIERS = {
    "all": "one",
    "every": "one",
    "each": "one",
    "one": "all",
    "some": "all",
    "any": "every",
    "first": "last",
    "last": "first",
    "whole": "first",
    "entire": "last",
    "many": "few",
    "few": "many",
    "most": "least",
    "least": "most",
    "single": "every",
}
COMPARATIVES = {"more": "less", "less": "more", "fewer": "more", "most": "least", "least": "most"}
WH_SWAPS = {"why": "how", "how": "why", "what": "which", "when": "where", "where": "when"}
WH_SWAPS.update({"who": "what"})
AUX: tuple[str, ...] = (
    "is",
    "are",
    "was",
    "were",
    "can",
    "could",
    "should",
    "will",
    "would",
    "does",
    "do",
    "did",
    "has",
    "have",
    "must",
    "may",
)
CONTRACT = {
    "do not": "don't",
    "does not": "doesn't",
    "is not": "isn't",
    "are not": "aren't",
    "can not": "can't",
    "cannot": "can't",
    "will not": "won't",
    "i am": "I'm",
    "it is": "it's",
    "what is": "what's",
    "that is": "that's",
    "i have": "I've",
    "you are": "you're",
    "there is": "there's",
}
POLITE: tuple[str, ...] = (
    "Can you tell me: {}",
    "Please help: {}",
    "{} Thanks!",
    "Quick question - {}",
    "I was wondering, {}",
    "Hi, {}",
)
MODIFIERS: tuple[str, ...] = (
    "free",
    "new",
    "old",
    "large",
    "small",
    "local",
    "public",
    "private",
    "main",
    "shared",
    "default",
    "secondary",
    "online",
    "annual",
    "monthly",
)
