# `fourbit rl` through the command line (ctest cli_rl_sampler_precision), on the CPU: two steps of
# a fresh tiny model with the e2e4 NVFP4 sampler, once with per-token activation amaxes (the
# default `--sampler-recipe nvfp4`) and once with one amax per pass (`nvfp4-tensor-amax`). The
# per-token sampler equals its trainer to f32 rounding (K3 ~1e-13); the per-pass one does not, and
# the logged K3 shows it. Also: the metrics file, the checkpoint, and an unknown sampler precision
# refused with the allowed ones named.
# Run with -DFOURBIT=<the fourbit executable> -DWORK=<a scratch folder>.
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

function(run_rl sampler out_var)
  execute_process(COMMAND "${FOURBIT}" rl --device cpu --sampler-recipe ${sampler} --task add:digits=1 --steps 2
                          --prompts 2 --group 4 --eval-prompts 0 --out "${WORK}/${sampler}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "fourbit rl --sampler-recipe ${sampler} failed (exit ${rc})")
  endif()
  foreach(f rl_metrics.jsonl rl_checkpoint)
    if(NOT EXISTS "${WORK}/${sampler}/${f}")
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
message("K3 mean: per-token amax ${k3_token}, per-pass amax ${k3_pass}")
# if(LESS/GREATER) compares as doubles (scientific notation included).
if(NOT k3_token LESS 1e-9)
  message(FATAL_ERROR "per-token K3 ${k3_token} is not below 1e-9: the NVFP4 sampler no longer matches its trainer on the CPU")
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
