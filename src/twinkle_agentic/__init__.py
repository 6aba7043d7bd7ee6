"""``twinkle_agentic``: multi-turn rollouts in which the model calls tools and environments answer.

Subpackages (import from them; nothing heavy is imported here):

- ``twinkle_agentic.envs``: ``Env``, ``StepResult``, ``EnvPool`` (N environments, one slot per
  trajectory, in-process or on Ray workers), ``EnvPoolAdapter``, ``EnvTool``, ``OpenEnv`` (an
  OpenEnv server over HTTP, or an OpenEnv-style class in-process), ``OpenSpielEnv``,
  ``ArithmeticEnv`` (a bundled calculator task).
- ``twinkle_agentic.tools``: ``Tool``, ``FunctionTool``, ``ToolManager`` (JSON-schema specs,
  tool calls parsed from the chat template's format, execution with a timeout),
  ``parse_tool_calls``, ``TOOL_FORMATS``.
- ``twinkle_agentic.rollout``: ``Rollout``, ``MultiTurnRollout``, ``ClientMultiTurnRollout``,
  ``RolloutMetrics``.
- ``twinkle_agentic.preprocessor``: quality steps for chat data run by ``QualityPreprocessor``.
- ``twinkle_agentic.protocol``: ``OpenAI``, a client of OpenAI-compatible chat endpoints.
- ``twinkle_agentic.reward``: ``F1Reward``, ``CoTReward``, ``ToolExploreReward``.
- ``twinkle_agentic.chunker`` and ``twinkle_agentic.data_format``: ``NativeChunker``, ``Chunks``.
- Upstream's condenser experiment (``condenser.ModelCondenser``,
  ``rollout.multi_turn_condense.MultiTurnCondenseRollout``, ``rollout.APIMultiTurnRollout``,
  ``tools.extract_condensed.ExtractCondensed``) imports and refuses in one line when built.

The package imports ``twinkle``; ``twinkle`` never imports it (as ``twinkle_client``)."""
