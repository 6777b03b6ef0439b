"""User reward functions for the reward tests (imported as `user_rewards:NAME`)."""

NOT_CALLABLE = 3


def length_score(prompt: str, response: str, answer: str) -> float:
    return float(len(response))


class Scorers:
    @staticmethod
    def first_char_match(prompt: str, response: str, answer: str) -> float:
        return float(response[:1] == answer[:1])


SLOW_S = 0.05  # the known time one call of slow_length_score takes


def slow_brevity_score(prompt: str, response: str, answer: str) -> float:
    """brevity_score, taking SLOW_S seconds (the streaming-scoring test)."""
    import time

    time.sleep(SLOW_S)
    return -float(len(response))


def brevity_score(prompt: str, response: str, answer: str) -> float:
    """Dense and pushing towards short answers: responses end at varied lengths (the
    over-sampling tests need groups that complete at different steps)."""
    return -float(len(response))


SLOW_EXACT_S = 0.04  # the known time one call of slow_exact_match takes


def slow_exact_match(prompt: str, response: str, answer: str) -> float:
    """The built-in exact_match, taking SLOW_EXACT_S seconds (test_streaming_scoring)."""
    import time

    from miles_like.scoring.rewards import exact_match

    time.sleep(SLOW_EXACT_S)
    return exact_match(prompt, response, answer)


SLEEP_S = 0.05


def sleepy_length_score(prompt: str, response: str, answer: str) -> float:
    """length_score after SLEEP_S of doing nothing on any device (the idle test)."""
    import time

    time.sleep(SLEEP_S)
    return float(len(response))


def parity_score(prompt: str, response: str, answer: str) -> float:
    """1 for a response of odd length, else 0: a group of n = 2 is informative (rewards 0 and
    1, standard deviation exactly 0.5) about half the time (the dynamic-sampling tests)."""
    return float(len(response) % 2)


def constant_score(prompt: str, response: str, answer: str) -> float:
    """The same reward for every response: no group is informative."""
    return 1.0
