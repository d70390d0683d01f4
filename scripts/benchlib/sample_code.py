"""The code tasks of the embedded sample data's coding instructions (`sample_text.Gen.code`): each
draws its arguments from the seeded `random.Random` it is given and returns (task, function name,
function body, an example call, its result), in a fixed order (the generated files depend on it)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable


def _t_reverse(r: random.Random):
    s = r.choice(["hello", "packing", "python", "level", "stream"])
    body = 'def reverse_string(s: str) -> str:\n    """Return s reversed."""\n    return s[::-1]'
    return "reverses a string", "reverse_string", body, f"reverse_string({s!r})", repr(s[::-1])


def _t_even_sum(r: random.Random):
    xs = [r.randint(0, 20) for _ in range(r.randint(3, 7))]
    body = (
        "def sum_even(numbers: list[int]) -> int:\n    total = 0\n    for n in numbers:\n"
        "        if n % 2 == 0:\n            total += n\n    return total"
    )
    return ("returns the sum of the even numbers in a list", "sum_even", body, f"sum_even({xs})", str(sum(x for x in xs if x % 2 == 0)))


def _t_prime(r: random.Random):
    n = r.randint(2, 100)
    body = (
        "def is_prime(n: int) -> bool:\n    if n < 2:\n        return False\n    i = 2\n"
        "    while i * i <= n:\n        if n % i == 0:\n            return False\n        i += 1\n"
        "    return True"
    )
    ok = n >= 2 and all(n % i for i in range(2, int(n**0.5) + 1))
    return "checks whether a number is prime", "is_prime", body, f"is_prime({n})", str(ok)


def _t_factorial(r: random.Random):
    n = r.randint(0, 12)
    body = "def factorial(n: int) -> int:\n    result = 1\n    for k in range(2, n + 1):\n        result *= k\n    return result"
    return "computes the factorial of n", "factorial", body, f"factorial({n})", str(math.factorial(n))


def _t_fib(r: random.Random):
    n = r.randint(1, 15)
    body = (
        "def fibonacci(n: int) -> list[int]:\n    seq = [0, 1]\n    while len(seq) < n:\n"
        "        seq.append(seq[-1] + seq[-2])\n    return seq[:n]"
    )
    seq = [0, 1]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    return ("returns the first n Fibonacci numbers", "fibonacci", body, f"fibonacci({n})", str(seq[:n]))


def _t_dedup(r: random.Random):
    xs = [r.randint(1, 6) for _ in range(r.randint(4, 9))]
    body = (
        "def dedupe(items: list) -> list:\n    seen = set()\n    out = []\n    for x in items:\n"
        "        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out"
    )
    return ("removes duplicates from a list while keeping the order", "dedupe", body, f"dedupe({xs})", str(list(dict.fromkeys(xs))))


def _t_celsius(r: random.Random):
    c = r.randint(-20, 40)
    body = "def to_fahrenheit(celsius: float) -> float:\n    return celsius * 9 / 5 + 32"
    return ("converts Celsius to Fahrenheit", "to_fahrenheit", body, f"to_fahrenheit({c})", str(c * 9 / 5 + 32))


def _t_palindrome(r: random.Random):
    s = r.choice(["racecar", "level", "python", "noon", "packing", "madam"])
    body = (
        "def is_palindrome(text: str) -> bool:\n    cleaned = ''.join(c.lower() for c in text "
        "if c.isalnum())\n    return cleaned == cleaned[::-1]"
    )
    return ("checks whether a string is a palindrome", "is_palindrome", body, f"is_palindrome({s!r})", str(s == s[::-1]))


def _t_count_words(r: random.Random):
    s = " ".join(r.choice(["the", "cat", "sat", "on", "mat", "a", "dog"]) for _ in range(6))
    body = (
        "def count_words(text: str) -> dict[str, int]:\n    counts = {}\n"
        "    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n"
        "    return counts"
    )
    counts: dict[str, int] = {}
    for w in s.split():
        counts[w] = counts.get(w, 0) + 1
    return "counts how often each word appears in a text", "count_words", body, f"count_words({s!r})", str(counts)


def _t_max(r: random.Random):
    xs = [r.randint(-50, 50) for _ in range(r.randint(3, 8))]
    body = (
        "def largest(numbers: list[int]) -> int:\n    best = numbers[0]\n    for n in numbers[1:]:\n"
        "        if n > best:\n            best = n\n    return best"
    )
    return "finds the largest number in a list", "largest", body, f"largest({xs})", str(max(xs))


def _t_bsearch(r: random.Random):
    xs = sorted(r.sample(range(1, 60), 8))
    x = r.choice(xs + [61])
    body = (
        "def binary_search(items: list[int], target: int) -> int:\n    lo, hi = 0, len(items) - 1\n"
        "    while lo <= hi:\n        mid = (lo + hi) // 2\n        if items[mid] == target:\n"
        "            return mid\n        if items[mid] < target:\n            lo = mid + 1\n"
        "        else:\n            hi = mid - 1\n    return -1"
    )
    return (
        "performs binary search on a sorted list",
        "binary_search",
        body,
        f"binary_search({xs}, {x})",
        str(xs.index(x) if x in xs else -1),
    )


CODE_TASKS: list[Callable[[random.Random], tuple[str, str, str, str, str]]] = [
    _t_reverse,
    _t_even_sum,
    _t_prime,
    _t_factorial,
    _t_fib,
    _t_dedup,
    _t_celsius,
    _t_palindrome,
    _t_count_words,
    _t_max,
    _t_bsearch,
]
