"""The reward function of the Tunix CLI tests' configs (`reward_functions: [tunix_cli_rewards]`).

Tunix's pipeline takes every public function defined in this module as a
reward function, so it defines exactly one.
"""

from demo import toyrun


def answer_word_reward(prompts, completions, answer, **kwargs):
  """The toy run's reward: uses of the answer word, minus a little per word."""
  return toyrun.reward_fn(prompts, completions, answer, **kwargs)
