# CMake package of the treeattn C library, installed by `cargo cinstall
# --prefix P` (capi/) as P/share/treeattn/cmake/treeattnConfig.cmake, where
# find_package(treeattn) looks when P is on CMAKE_PREFIX_PATH.
#
#   find_package(treeattn REQUIRED)
#   target_link_libraries(app PRIVATE treeattn::treeattn)   # the shared library, <treeattn.h>
#
# The paths are found relative to this file, so the prefix can be moved.
get_filename_component(_treeattn_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
find_library(TREEATTN_LIBRARY NAMES treeattn
  PATHS "${_treeattn_prefix}"
  PATH_SUFFIXES lib lib64 "lib/${CMAKE_LIBRARY_ARCHITECTURE}"
  NO_DEFAULT_PATH)
find_path(TREEATTN_INCLUDE_DIR treeattn.h PATHS "${_treeattn_prefix}/include" NO_DEFAULT_PATH)
if(NOT TREEATTN_LIBRARY OR NOT TREEATTN_INCLUDE_DIR)
  set(treeattn_FOUND FALSE)
  set(treeattn_NOT_FOUND_MESSAGE
    "treeattn: no libtreeattn or treeattn.h under ${_treeattn_prefix} (install with cargo cinstall --prefix)")
  return()
endif()
if(NOT TARGET treeattn::treeattn)
  add_library(treeattn::treeattn SHARED IMPORTED)
  set_target_properties(treeattn::treeattn PROPERTIES
    IMPORTED_LOCATION "${TREEATTN_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${TREEATTN_INCLUDE_DIR}")
endif()
set(treeattn_FOUND TRUE)
