# `fourbit rl` through the command line (ctest cli_rl_sampler_precision), on the CPU: two steps of
# a fresh tiny model with the e2e4 NVFP4 sampler, once with per-token activation amaxes (the
# default `--sampler-recipe nvfp4`) and once with one amax per pass (`nvfp4-tensor-amax`). The
# per-token sampler equals its trainer to f32 rounding (K3 ~1e-13) when the CPU GEMM is
# batch-invariant; the per-pass one does not, and the logged K3 shows it. Also: the metrics file,
# the checkpoint, and an unknown sampler precision refused with the allowed ones named.
#
# Batch invariance: the sampler multiplies a few rows at a time, the trainer the whole sequence.
# OpenBLAS's FMA kernels (Haswell, also picked on AMD Zen) round a row differently depending on
# its position in the tile and on the batch (measured in session 15 on an AMD EPYC: per-token K3
# 4.4e-6, max |dlogp| 2.7e-2: the NVFP4 quantizer turns an f32 ulp into another FP4 code), while
# its Sandybridge kernels (no FMA) gave the same bits for a row in every batch tried. So the
# exactness check runs with OPENBLAS_CORETYPE=Sandybridge (Debian's OpenBLAS is built with
# DYNAMIC_ARCH and honours it; a build without OpenBLAS uses the naive reference GEMM, invariant
# by construction); with the machine's own kernels the per-token K3 must stay below 1e-4.
# Run with -DFOURBIT=<the fourbit executable> -DWORK=<a scratch folder>.
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

# run_rl(sampler out_var [coretype]): coretype, if given, is passed as OPENBLAS_CORETYPE.
function(run_rl sampler out_var)
  set(env_prefix "")
  set(dir "${WORK}/${sampler}")
  if(ARGC GREATER 2)
    set(env_prefix "${CMAKE_COMMAND}" -E env "OPENBLAS_CORETYPE=${ARGV2}")
    set(dir "${WORK}/${sampler}-${ARGV2}")
  endif()
  execute_process(COMMAND ${env_prefix} "${FOURBIT}" rl --device cpu --sampler-recipe ${sampler} --task add:digits=1 --steps 2
                          --prompts 2 --group 4 --eval-prompts 0 --out "${dir}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "fourbit rl --sampler-recipe ${sampler} failed (exit ${rc})")
  endif()
  foreach(f rl_metrics.jsonl rl_checkpoint)
    if(NOT EXISTS "${dir}/${f}")
      message(FATAL_ERROR "fourbit rl --sampler-recipe ${sampler} did not write ${f}")
    endif()
  endforeach()
  # The summary is the JSON object at the end of stdout (progress lines come before it).
  string(FIND "${out}" "{" at)
  if(at LESS 0)
    message(FATAL_ERROR "fourbit rl --sampler-recipe ${sampler} printed no JSON summary")
  endif()
  string(SUBSTRING "${out}" ${at} -1 summary)
  string(JSON k3 GET "${summary}" k3_mean)
  string(JSON recipe GET "${summary}" recipe)
  if(NOT recipe STREQUAL "e2e4+sampler-${sampler}")
    message(FATAL_ERROR "the summary names recipe '${recipe}', expected e2e4+sampler-${sampler}")
  endif()
  set(${out_var} "${k3}" PARENT_SCOPE)
endfunction()

run_rl(nvfp4 k3_token)
run_rl(nvfp4-tensor-amax k3_pass)
run_rl(nvfp4 k3_token_invariant Sandybridge)
message("K3 mean: per-token amax ${k3_token} (${k3_token_invariant} with OpenBLAS's Sandybridge "
        "kernels), per-pass amax ${k3_pass}")
# if(LESS/GREATER) compares as doubles (scientific notation included).
if(NOT k3_token_invariant LESS 1e-9)
  message(FATAL_ERROR "per-token K3 ${k3_token_invariant} (batch-invariant CPU GEMM) is not below 1e-9: the NVFP4 sampler no longer matches its trainer on the CPU")
endif()
if(NOT k3_token LESS 1e-4)
  message(FATAL_ERROR "per-token K3 ${k3_token} (this machine's OpenBLAS kernels) is not below 1e-4")
endif()
if(NOT k3_pass GREATER 1e-7)
  message(FATAL_ERROR "per-pass K3 ${k3_pass} is not above 1e-7: the metric no longer shows the per-pass amax's mismatch")
endif()

execute_process(COMMAND "${FOURBIT}" rl --device cpu --sampler-recipe nvfp8 --steps 1 --out ""
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "nvfp4-tensor-amax" OR NOT err MATCHES "nvfp8")
  message(FATAL_ERROR "an unknown --sampler-recipe must be refused naming it and the choices; got exit ${rc}:\n${out}${err}")
endif()
message("cli rl: PASS")
