"""What the side-by-side benchmarks share: the summary of alternating rounds, each round a dict with
`ember_tokens_per_sec` and `torch_tokens_per_sec`."""
import statistics


def summarize(rounds, **fields):
    """`fields`, the rounds, the median rate of each side and the median, least and largest ratio
    ember/torch over the rounds."""
    ratios = [x["ember_tokens_per_sec"] / x["torch_tokens_per_sec"] for x in rounds]
    med = lambda key: statistics.median(x[key] for x in rounds)
    return {**fields, "rounds": rounds,
            "ember_tokens_per_sec": med("ember_tokens_per_sec"), "torch_tokens_per_sec": med("torch_tokens_per_sec"),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
