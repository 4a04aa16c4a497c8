from titanrl.generator.engine import Completion, GenerationStats, Generator, GeneratorOptions
from titanrl.generator.sampling import SamplingParams

__all__ = ["Completion", "GenerationStats", "Generator", "GeneratorOptions", "SamplingParams"]
