# `fourbit export`, `fourbit import` and `fourbit audit` through the command line (ctest
# cli_export_import_audit): a fresh tiny model exported as an F32 HF checkpoint with reference
# logits, imported back as a fourbit checkpoint, audited from that checkpoint with a JSON report;
# moe-tiny (dense and MoE blocks) exported as Qwen2-MoE; the refusals that name what is wrong (a
# Qwen2-MoE import, a folder without weights).
# Run with -DFOURBIT=<the fourbit executable> -DWORK=<a scratch folder>.
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

function(run_ok what)
  execute_process(COMMAND "${FOURBIT}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (exit ${rc}):\n${out}${err}")
  endif()
  set(last_out "${out}" PARENT_SCOPE)
endfunction()

run_ok("export" export --preset tiny --format f32 --reference-logits --ref-batch 1 --ref-seq 16 --out "${WORK}/hf")
foreach(f model.safetensors config.json tokenizer.json fourbit_reference/logits.f64 fourbit_reference/tokens.i32)
  if(NOT EXISTS "${WORK}/hf/${f}")
    message(FATAL_ERROR "fourbit export did not write ${f}")
  endif()
endforeach()
if(NOT last_out MATCHES "LlamaForCausalLM")
  message(FATAL_ERROR "unexpected export summary:\n${last_out}")
endif()

run_ok("import" import --hf "${WORK}/hf" --out "${WORK}/ckpt" --recipe nvfp4)
foreach(f model.safetensors state.json)
  if(NOT EXISTS "${WORK}/ckpt/${f}")
    message(FATAL_ERROR "fourbit import did not write ${f}")
  endif()
endforeach()

run_ok("audit" audit --ckpt "${WORK}/ckpt" --stages pretrain_forward,rl_sampler --batch 1 --seq 32
       --json "${WORK}/audit.json")
if(NOT last_out MATCHES "== pretrain_forward ==" OR NOT last_out MATCHES "nvfp4 1x16 rn" OR
   NOT last_out MATCHES "summary")
  message(FATAL_ERROR "unexpected audit table:\n${last_out}")
endif()
file(READ "${WORK}/audit.json" audit_json)
string(JSON n_sampler LENGTH "${audit_json}" stages rl_sampler)
if(NOT n_sampler EQUAL 17)
  message(FATAL_ERROR "audit.json: ${n_sampler} rl_sampler GEMMs, expected 17 (4 blocks x 4 + lm_head)")
endif()

run_ok("export moe-tiny" export --preset moe-tiny --out "${WORK}/moe")
if(NOT last_out MATCHES "Qwen2MoeForCausalLM")
  message(FATAL_ERROR "moe-tiny (dense blocks among MoE blocks) should export as Qwen2-MoE:\n${last_out}")
endif()
execute_process(COMMAND "${FOURBIT}" import --hf "${WORK}/moe" --out "${WORK}/ckpt-moe"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "qwen2_moe")
  message(FATAL_ERROR "importing a Qwen2-MoE checkpoint should be refused naming its model_type:\n${out}${err}")
endif()

file(REMOVE "${WORK}/hf/model.safetensors")
execute_process(COMMAND "${FOURBIT}" import --hf "${WORK}/hf" --out "${WORK}/ckpt2"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "model.safetensors")
  message(FATAL_ERROR "importing a folder without weights should be refused naming the file:\n${out}${err}")
endif()
