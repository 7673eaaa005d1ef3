# `fourbit prepare` through the command line (ctest cli_prepare_byte_level): a tiny text file to
# byte-level shards, the summary, the files, and the refusal to overwrite without --overwrite.
# Run with -DFOURBIT=<the fourbit executable> -DWORK=<a scratch folder>.
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
set(text "")
foreach(i RANGE 1 60)
  string(APPEND text "line ${i}: the quick brown fox jumps over the lazy dog\n")
endforeach()
file(WRITE "${WORK}/input.txt" "${text}")

execute_process(COMMAND "${FOURBIT}" prepare "${WORK}/input.txt" --out "${WORK}/data" --byte-level
                        --documents line --val-fraction 0.1 --shard-tokens 1000
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "fourbit prepare failed (exit ${rc})")
endif()
foreach(f meta.json train_000000.bin train_000001.bin val_000000.bin)
  if(NOT EXISTS "${WORK}/data/${f}")
    message(FATAL_ERROR "fourbit prepare did not write ${f}")
  endif()
endforeach()
if(NOT out MATCHES "train: +[0-9]+ tokens in [0-9]+ shard" OR NOT out MATCHES "byte-level")
  message(FATAL_ERROR "unexpected summary:\n${out}")
endif()

execute_process(COMMAND "${FOURBIT}" prepare "${WORK}/input.txt" --out "${WORK}/data" --byte-level
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "already holds a prepared dataset")
  message(FATAL_ERROR "a second prepare into the same folder should be refused:\n${out}${err}")
endif()
