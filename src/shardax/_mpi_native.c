/* The MPI transport's native call: one XLA FFI handler that runs an sx.comm collective with a single MPI call
 * straight between XLA's buffers (no Python, no copy of the data on the host).
 *
 * Built on first use by shardax._mpi_native with the MPI compiler wrapper that mpi4py was built with, against the
 * XLA FFI C API headers that jaxlib ships (jax.ffi.include_dir()), and loaded into the process that mpi4py already
 * linked to the same MPI library. Used when every process holds one device of the collective's group (each process
 * is one rank of it): the device's thread makes the MPI call itself.
 *
 * Attributes (all int64; XLA passes them sorted by name):
 *   comm    index of the communicator in the table filled by shardax_mpi_set_comm
 *   kind    0: allreduce, 1: alltoallv of rows (ragged), 2: static routing of units (allgather, alltoall, permute)
 *   op      allreduce: 0 sum, 1 prod, 2 max, 3 min
 *   ranks   ragged: MPI rank of each rank of the collective's group (array)
 *   units   routing: units of the input (each of input bytes / units bytes)
 *   route   routing: 4 x nprocs (send count, send offset, receive count, receive offset) in units, by MPI rank
 *   zero    routing: 1 when some output units receive nothing (they are zeroed first)
 */

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

#define MAX_COMMS 64

static MPI_Comm comms[MAX_COMMS];

/* Called from Python (ctypes): the communicator mpi4py handed out, by its handle. */
int shardax_mpi_set_comm(int index, int64_t handle) {
  if (index < 0 || index >= MAX_COMMS) return 1;
  comms[index] = (MPI_Comm)(intptr_t)handle;
  return 0;
}

/* For the tests: the size of the communicator at ``index`` as MPI sees it (-1 if unset or invalid). */
int shardax_mpi_comm_size(int index) {
  int size = -1;
  if (index < 0 || index >= MAX_COMMS) return -1;
  if (MPI_Comm_size(comms[index], &size) != MPI_SUCCESS) return -1;
  return size;
}

/* For the loader: the MPI library this handler calls (it must be the one mpi4py loaded). */
int shardax_mpi_library_version(char* out, int size) {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return 1;
  snprintf(out, (size_t)size, "%.*s", len, text);
  return 0;
}

static XLA_FFI_Error* fail(const XLA_FFI_CallFrame* frame, const char* message) {
  XLA_FFI_Error_Create_Args args;
  memset(&args, 0, sizeof(args));
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = message;
  args.errc = XLA_FFI_Error_Code_INTERNAL;
  return frame->api->XLA_FFI_Error_Create(&args);
}

static XLA_FFI_Error* mpi_fail(const XLA_FFI_CallFrame* frame, const char* what, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  static __thread char message[MPI_MAX_ERROR_STRING + 128];
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) snprintf(text, sizeof(text), "error code %d", code);
  snprintf(message, sizeof(message), "shardax MPI transport: %s failed: %s", what, text);
  return fail(frame, message);
}

/* The attribute called ``name``: a pointer to its XLA_FFI_Scalar or XLA_FFI_Array, or NULL. */
static void* attr(const XLA_FFI_CallFrame* frame, const char* name, XLA_FFI_AttrType type) {
  size_t len = strlen(name);
  for (int64_t i = 0; i < frame->attrs.size; ++i) {
    const XLA_FFI_ByteSpan* key = frame->attrs.names[i];
    if (key->len == len && memcmp(key->ptr, name, len) == 0 && frame->attrs.types[i] == type)
      return frame->attrs.attrs[i];
  }
  return NULL;
}

static int scalar(const XLA_FFI_CallFrame* frame, const char* name, int64_t* out) {
  const XLA_FFI_Scalar* s = (const XLA_FFI_Scalar*)attr(frame, name, XLA_FFI_AttrType_SCALAR);
  if (s == NULL || s->dtype != XLA_FFI_DataType_S64) return 0;
  *out = *(const int64_t*)s->value;
  return 1;
}

static const int64_t* array(const XLA_FFI_CallFrame* frame, const char* name, size_t* size) {
  const XLA_FFI_Array* a = (const XLA_FFI_Array*)attr(frame, name, XLA_FFI_AttrType_ARRAY);
  if (a == NULL || a->dtype != XLA_FFI_DataType_S64) return NULL;
  *size = a->size;
  return (const int64_t*)a->data;
}

static size_t dtype_bytes(XLA_FFI_DataType t) {
  switch (t) {
    case XLA_FFI_DataType_PRED: case XLA_FFI_DataType_S8: case XLA_FFI_DataType_U8: return 1;
    case XLA_FFI_DataType_S16: case XLA_FFI_DataType_U16: case XLA_FFI_DataType_F16: case XLA_FFI_DataType_BF16:
      return 2;
    case XLA_FFI_DataType_S32: case XLA_FFI_DataType_U32: case XLA_FFI_DataType_F32: return 4;
    case XLA_FFI_DataType_S64: case XLA_FFI_DataType_U64: case XLA_FFI_DataType_F64: case XLA_FFI_DataType_C64:
      return 8;
    case XLA_FFI_DataType_C128: return 16;
    default: return 0;
  }
}

/* The MPI type of a reduction's elements (MPI_DATATYPE_NULL where shardax keeps the host path). */
static MPI_Datatype reduce_type(XLA_FFI_DataType t) {
  switch (t) {
    case XLA_FFI_DataType_S8: return MPI_INT8_T;
    case XLA_FFI_DataType_U8: return MPI_UINT8_T;
    case XLA_FFI_DataType_S16: return MPI_INT16_T;
    case XLA_FFI_DataType_U16: return MPI_UINT16_T;
    case XLA_FFI_DataType_S32: return MPI_INT32_T;
    case XLA_FFI_DataType_U32: return MPI_UINT32_T;
    case XLA_FFI_DataType_S64: return MPI_INT64_T;
    case XLA_FFI_DataType_U64: return MPI_UINT64_T;
    case XLA_FFI_DataType_F32: return MPI_FLOAT;
    case XLA_FFI_DataType_F64: return MPI_DOUBLE;
    case XLA_FFI_DataType_C64: return MPI_C_FLOAT_COMPLEX;
    case XLA_FFI_DataType_C128: return MPI_C_DOUBLE_COMPLEX;
    default: return MPI_DATATYPE_NULL;
  }
}

static size_t elements(const XLA_FFI_Buffer* b) {
  size_t n = 1;
  for (int64_t i = 0; i < b->rank; ++i) n *= (size_t)b->dims[i];
  return n;
}

static XLA_FFI_Error* allreduce(const XLA_FFI_CallFrame* frame, MPI_Comm comm) {
  const XLA_FFI_Buffer* x = (const XLA_FFI_Buffer*)frame->args.args[0];
  XLA_FFI_Buffer* out = (XLA_FFI_Buffer*)frame->rets.rets[0];
  int64_t op_code = 0;
  if (!scalar(frame, "op", &op_code)) return fail(frame, "shardax MPI transport: allreduce without its op");
  MPI_Op op = op_code == 0 ? MPI_SUM : op_code == 1 ? MPI_PROD : op_code == 2 ? MPI_MAX : MPI_MIN;
  MPI_Datatype type = reduce_type(x->dtype);
  if (type == MPI_DATATYPE_NULL) return fail(frame, "shardax MPI transport: allreduce of an unsupported dtype");
  size_t n = elements(x);
  if (n > INT32_MAX) return fail(frame, "shardax MPI transport: allreduce of more than 2**31 elements");
  const void* send = x->data == out->data ? MPI_IN_PLACE : x->data;
  int code = MPI_Allreduce(send, out->data, (int)n, type, op, comm);
  return code == MPI_SUCCESS ? NULL : mpi_fail(frame, "MPI_Allreduce", code);
}

/* A contiguous MPI type of ``bytes`` bytes (rows or units are counted in it, so counts stay small). */
static int block_type(size_t bytes, MPI_Datatype* type) {
  if (bytes > INT32_MAX) return MPI_ERR_COUNT;
  int code = MPI_Type_contiguous((int)bytes, MPI_BYTE, type);
  if (code != MPI_SUCCESS) return code;
  return MPI_Type_commit(type);
}

/* Rows ``x (n, ...)`` with ``send_counts (size,)`` (rank order of the group) to ``data (capacity, ...)``, packed by
 * source rank, zeros after, and ``recv_counts (size,)``; rows past ``capacity`` are not sent. Every process learns
 * every count first (one MPI_Allgather), so both ends of a message agree on what capacity lets through. */
static XLA_FFI_Error* ragged(const XLA_FFI_CallFrame* frame, MPI_Comm comm) {
  const XLA_FFI_Buffer* x = (const XLA_FFI_Buffer*)frame->args.args[0];
  const XLA_FFI_Buffer* counts_in = (const XLA_FFI_Buffer*)frame->args.args[1];
  XLA_FFI_Buffer* data = (XLA_FFI_Buffer*)frame->rets.rets[0];
  XLA_FFI_Buffer* counts_out = (XLA_FFI_Buffer*)frame->rets.rets[1];
  size_t size = 0;
  const int64_t* ranks = array(frame, "ranks", &size);
  if (ranks == NULL) return fail(frame, "shardax MPI transport: alltoallv without its ranks");
  int nprocs = 0, me = 0;
  MPI_Comm_size(comm, &nprocs);
  MPI_Comm_rank(comm, &me);
  if ((size_t)nprocs != size) return fail(frame, "shardax MPI transport: alltoallv over a group that is not the world");
  int64_t n = x->rank > 0 ? x->dims[0] : 0;
  int64_t capacity = data->rank > 0 ? data->dims[0] : 0;
  size_t row_bytes = n > 0 ? elements(x) / (size_t)n * dtype_bytes(x->dtype) : 0;
  if (n == 0) row_bytes = capacity > 0 ? elements(data) / (size_t)capacity * dtype_bytes(data->dtype) : 0;
  const int32_t* want = (const int32_t*)counts_in->data;

  /* This rank's counts by group rank, clipped to the rows that are there. */
  int64_t* table = (int64_t*)calloc(size * size * 2 + size * 6, sizeof(int64_t));
  if (table == NULL) return fail(frame, "shardax MPI transport: out of host memory");
  int64_t* mine = table + size * size;          /* (size,) */
  int64_t* start = mine + size;                 /* (size,) where my rows to each rank start */
  int* scount = (int*)(start + size);
  int* sdispl = scount + size;
  int* rcount = sdispl + size;
  int* rdispl = rcount + size;
  int64_t* every = (int64_t*)(rdispl + size);   /* (size, size) by MPI rank of the source */
  int64_t end = 0;
  for (size_t r = 0; r < size; ++r) {
    int64_t c = want[r] > 0 ? want[r] : 0;
    int64_t stop = end + c < n ? end + c : n;
    mine[r] = stop - end;
    start[r] = end;
    end = stop;
  }
  int code = MPI_Allgather(mine, (int)size, MPI_INT64_T, every, (int)size, MPI_INT64_T, comm);
  if (code != MPI_SUCCESS) {
    free(table);
    return mpi_fail(frame, "MPI_Allgather", code);
  }
  /* table[s * size + t]: rows group rank s sends group rank t (every is by MPI rank of s). */
  for (size_t s = 0; s < size; ++s)
    for (size_t t = 0; t < size; ++t) table[s * size + t] = every[(size_t)ranks[s] * size + t];
  /* Who am I in the group? */
  size_t self = 0;
  for (size_t r = 0; r < size; ++r)
    if (ranks[r] == me) self = r;
  /* Sends: to group rank t, the rows that fit below t's capacity after the rows of the ranks before me. */
  for (size_t t = 0; t < size; ++t) {
    int64_t before = 0;
    for (size_t s = 0; s < self; ++s) before += table[s * size + t];
    int64_t room = capacity - before;
    int64_t c = table[self * size + t];
    c = c < room ? c : room;
    c = c > 0 ? c : 0;
    int p = (int)ranks[t];
    scount[p] = (int)c;
    sdispl[p] = (int)start[t];
  }
  /* Receives: from group rank s, packed in group rank order, cut at capacity. */
  int64_t at = 0;
  int32_t* got = (int32_t*)counts_out->data;
  for (size_t s = 0; s < size; ++s) {
    int64_t c = table[s * size + self];
    got[s] = (int32_t)c;
    int64_t keep = capacity - at < c ? capacity - at : c;
    keep = keep > 0 ? keep : 0;
    int p = (int)ranks[s];
    rcount[p] = (int)keep;
    rdispl[p] = (int)at;
    at += keep;
  }
  MPI_Datatype row;
  code = block_type(row_bytes > 0 ? row_bytes : 1, &row);
  if (code == MPI_SUCCESS)
    code = MPI_Alltoallv(x->data, scount, sdispl, row, data->data, rcount, rdispl, row, comm);
  free(table);
  if (code != MPI_SUCCESS) return mpi_fail(frame, "MPI_Alltoallv", code);
  MPI_Type_free(&row);
  if (at < capacity) memset((char*)data->data + at * row_bytes, 0, (size_t)(capacity - at) * row_bytes);
  return NULL;
}

/* Units of the input to units of the output along a static route (per MPI rank: what is sent from where, what
 * arrives where), one MPI_Alltoallv. */
static XLA_FFI_Error* routed(const XLA_FFI_CallFrame* frame, MPI_Comm comm) {
  const XLA_FFI_Buffer* x = (const XLA_FFI_Buffer*)frame->args.args[0];
  XLA_FFI_Buffer* out = (XLA_FFI_Buffer*)frame->rets.rets[0];
  int64_t units = 1, zero = 0;
  size_t len = 0;
  const int64_t* route = array(frame, "route", &len);
  if (route == NULL || !scalar(frame, "units", &units) || !scalar(frame, "zero", &zero) || units < 1)
    return fail(frame, "shardax MPI transport: a routed collective without its route");
  int nprocs = 0;
  MPI_Comm_size(comm, &nprocs);
  if (len != 4 * (size_t)nprocs) return fail(frame, "shardax MPI transport: a route for another number of processes");
  size_t unit_bytes = elements(x) * dtype_bytes(x->dtype) / (size_t)units;
  int* c = (int*)malloc(4 * (size_t)nprocs * sizeof(int));
  if (c == NULL) return fail(frame, "shardax MPI transport: out of host memory");
  for (size_t i = 0; i < len; ++i) c[i] = (int)route[i];
  if (zero) memset(out->data, 0, elements(out) * dtype_bytes(out->dtype));
  MPI_Datatype unit;
  int code = block_type(unit_bytes > 0 ? unit_bytes : 1, &unit);
  if (code == MPI_SUCCESS)
    code = MPI_Alltoallv(x->data, c, c + nprocs, unit, out->data, c + 2 * nprocs, c + 3 * nprocs, unit, comm);
  free(c);
  if (code != MPI_SUCCESS) return mpi_fail(frame, "MPI_Alltoallv", code);
  MPI_Type_free(&unit);
  return NULL;
}

XLA_FFI_Error* shardax_mpi_collective(XLA_FFI_CallFrame* frame) {
  XLA_FFI_Extension_Base* ext = frame->extension_start;
  if (ext != NULL && ext->type == XLA_FFI_Extension_Metadata) {  /* XLA asks which API this handler speaks */
    XLA_FFI_Metadata_Extension* meta = (XLA_FFI_Metadata_Extension*)ext;
    meta->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
    meta->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
    meta->metadata->traits = 0;
    return NULL;
  }
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  int64_t index = -1, kind = -1;
  if (!scalar(frame, "comm", &index) || !scalar(frame, "kind", &kind) || index < 0 || index >= MAX_COMMS)
    return fail(frame, "shardax MPI transport: a call without its communicator");
  MPI_Comm comm = comms[index];
  if (kind == 0) return allreduce(frame, comm);
  if (kind == 1) return ragged(frame, comm);
  if (kind == 2) return routed(frame, comm);
  return fail(frame, "shardax MPI transport: unknown collective");
}
