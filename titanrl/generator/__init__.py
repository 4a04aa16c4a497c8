from titanrl.generator.generator import Completion, GenerationStats, Generator, PauseWhen, ResumedSample
from titanrl.generator.sampling import SamplingParams

__all__ = ["Completion", "GenerationStats", "Generator", "PauseWhen", "ResumedSample", "SamplingParams"]
