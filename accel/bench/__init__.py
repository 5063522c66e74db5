"""`accel bench`: a recipe's variants measured side by side in one process group.

Every variant is the recipe with its overrides, measured by the same code as `accel run`
(`measure.measure_recipe`: warm-up, repeats, apply, remove) and compared with the first variant,
the baseline, for speed and for quality (PSNR, SSIM of its output against the baseline's).

One job runs them all. A variant that needs fewer processes than the job runs on its first ranks
(the others wait at a barrier); one that needs more, or hardware this machine lacks, is skipped
with the reason. Quantization and the tensor-parallel split cannot be undone, so the pipeline is
reloaded when a variant needs it unquantized (or quantized differently), or split otherwise, after one that changed it.
"""
