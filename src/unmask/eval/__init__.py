"""Evaluation: tasks (stories, GSM8K, HumanEval, MBPP), scorers, AUP, sweeps, the sandbox.

The scorers re-exported here are model-independent; ``unmask.eval.runner`` / ``tasks`` run
decoders on a task, and ``unmask.eval.quality`` scores generated token ids under a judge model.
"""

from unmask.eval.aup import aup, aup_weight
from unmask.eval.code_tasks import (
    CodeEvalResult,
    JudgedProgram,
    evaluate_humaneval,
    evaluate_mbpp,
    humaneval_judged,
    humaneval_program,
    mbpp_judged,
    mbpp_program,
    pass_at_1,
    postprocess_humaneval,
    postprocess_mbpp,
)
from unmask.eval.datasets import (
    GSM8KExample,
    HumanEvalTask,
    MBPPTask,
    find_data_dir,
    gsm8k_prompt,
    load_gsm8k,
    load_humaneval,
    load_mbpp,
    mbpp_prompt,
)
from unmask.eval.extract import extract_flexible, extract_strict, gsm8k_score
from unmask.eval.sandbox import RunResult, landlock_abi, run_program

__all__ = [
    "CodeEvalResult",
    "GSM8KExample",
    "HumanEvalTask",
    "JudgedProgram",
    "MBPPTask",
    "RunResult",
    "aup",
    "aup_weight",
    "evaluate_humaneval",
    "evaluate_mbpp",
    "extract_flexible",
    "extract_strict",
    "find_data_dir",
    "gsm8k_prompt",
    "gsm8k_score",
    "humaneval_judged",
    "humaneval_program",
    "landlock_abi",
    "load_gsm8k",
    "load_humaneval",
    "load_mbpp",
    "mbpp_judged",
    "mbpp_program",
    "mbpp_prompt",
    "pass_at_1",
    "postprocess_humaneval",
    "postprocess_mbpp",
    "run_program",
]
