from titanrl.generator.engine import Completion, GenerationStats, Generator
from titanrl.generator.sampling import SamplingParams

__all__ = ["Completion", "GenerationStats", "Generator", "SamplingParams"]
