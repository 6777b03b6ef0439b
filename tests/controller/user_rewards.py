"""User reward functions for the reward tests (imported as `user_rewards:NAME`)."""

NOT_CALLABLE = 3


def length_score(prompt: str, response: str, answer: str) -> float:
    return float(len(response))


class Scorers:
    @staticmethod
    def first_char_match(prompt: str, response: str, answer: str) -> float:
        return float(response[:1] == answer[:1])


SLEEP_S = 0.05


def sleepy_length_score(prompt: str, response: str, answer: str) -> float:
    """length_score after SLEEP_S of doing nothing on any device (the idle test)."""
    import time

    time.sleep(SLEEP_S)
    return float(len(response))
