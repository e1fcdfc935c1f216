/* The MPI transport's native call: one XLA FFI handler that runs an sx.comm collective with a single MPI call
 * straight between XLA's buffers (no Python, no copy of the data on the host).
 *
 * Built on first use by shardax._mpi_native with the MPI compiler wrapper that mpi4py was built with, against the
 * XLA FFI C API headers that jaxlib ships (jax.ffi.include_dir()), and loaded into the process that mpi4py already
 * linked to the same MPI library.
 *
 * With one device per process (each process is one rank of the group) the device's thread makes the MPI call
 * itself. With several devices per process (kinds 3 and 4, a group of every device), XLA:CPU runs each local device
 * on a thread of its own and every one of them enters the call: they meet at a barrier of the call site, reduce or
 * copy what stays in the process in parallel (shared memory), and one of them (the leader) makes the single MPI call
 * that crosses processes, reading and writing the devices' own buffers (MPI datatypes of absolute addresses).
 *
 * Attributes (all int64; XLA passes them sorted by name):
 *   comm    index of the communicator in the table filled by shardax_mpi_set_comm
 *   kind    0: allreduce, 1: alltoallv of rows (ragged), 2: static routing of units (allgather, alltoall, permute);
 *           3: allreduce, 4: alltoallv (or all_to_all, with ``fixed``), both with several devices per process (a
 *           first operand: the mesh position)
 *   op      allreduce: 0 sum, 1 prod, 2 max, 3 min
 *   ranks   ragged: MPI rank of each rank of the collective's group (array)
 *   units   routing: units of the input (each of input bytes / units bytes)
 *   route   routing: 4 x nprocs (send count, send offset, receive count, receive offset) in units, by MPI rank
 *   zero    routing: 1 when some output units receive nothing (they are zeroed first)
 *   site    kinds 3, 4: the call site (its barrier and the buffers its threads publish)
 *   local   kinds 3, 4: the mesh positions on this process, ascending (a thread's slot is its index here)
 *   procs   kind 4: MPI rank of each mesh position
 *   slots   kind 4: each position's slot on its own process
 *   members kind 4: the position of each rank of the group
 *   fixed   kind 4: rows per rank pair of an all_to_all (no counts operand, no counts result)
 */

#include <mpi.h>
#include <pthread.h>
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
  MPI_Datatype row = MPI_DATATYPE_NULL;
  code = block_type(row_bytes > 0 ? row_bytes : 1, &row);
  if (code == MPI_SUCCESS)
    code = MPI_Alltoallv(x->data, scount, sdispl, row, data->data, rcount, rdispl, row, comm);
  free(table);
  if (row != MPI_DATATYPE_NULL) MPI_Type_free(&row);
  if (code != MPI_SUCCESS) return mpi_fail(frame, "MPI_Alltoallv", code);
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
  MPI_Datatype unit = MPI_DATATYPE_NULL;
  int code = block_type(unit_bytes > 0 ? unit_bytes : 1, &unit);
  if (code == MPI_SUCCESS)
    code = MPI_Alltoallv(x->data, c, c + nprocs, unit, out->data, c + 2 * nprocs, c + 3 * nprocs, unit, comm);
  free(c);
  if (unit != MPI_DATATYPE_NULL) MPI_Type_free(&unit);
  if (code != MPI_SUCCESS) return mpi_fail(frame, "MPI_Alltoallv", code);
  return NULL;
}


/* ------------------------------------------------------------------------------------ several devices per process */

#define MAX_LOCAL 64  /* devices per process (the Python side keeps larger meshes on host calls) */

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int arrived;
  unsigned long generation;
  const void* in[MAX_LOCAL];
  void* out[MAX_LOCAL];
  const int32_t* counts[MAX_LOCAL];
  void* got[MAX_LOCAL];
  int64_t* table;          /* kind 4: rows from position s to group rank r, (ndev, size) */
  int status;              /* the leader's MPI result (kind 4: of its plan), for every thread */
  int moved;               /* kind 4: the result of the leader's MPI_Alltoallw */
} Site;

static pthread_mutex_t sites_mu = PTHREAD_MUTEX_INITIALIZER;
static Site** sites = NULL;
static int64_t nsites = 0;

static Site* site_of(int64_t id) {
  pthread_mutex_lock(&sites_mu);
  if (id >= nsites) {
    int64_t grow = id + 64;
    Site** more = (Site**)realloc(sites, (size_t)grow * sizeof(Site*));
    if (more == NULL) {
      pthread_mutex_unlock(&sites_mu);
      return NULL;
    }
    memset(more + nsites, 0, (size_t)(grow - nsites) * sizeof(Site*));
    sites = more;
    nsites = grow;
  }
  if (sites[id] == NULL) {
    Site* site = (Site*)calloc(1, sizeof(Site));
    if (site != NULL) {
      pthread_mutex_init(&site->mu, NULL);
      pthread_cond_init(&site->cv, NULL);
    }
    sites[id] = site;
  }
  Site* site = sites[id];
  pthread_mutex_unlock(&sites_mu);
  return site;
}

/* Every one of the ``count`` local threads waits here until all have arrived (reusable). */
static void meet(Site* site, int count) {
  pthread_mutex_lock(&site->mu);
  unsigned long generation = site->generation;
  if (++site->arrived == count) {
    site->arrived = 0;
    site->generation++;
    pthread_cond_broadcast(&site->cv);
  } else {
    while (generation == site->generation) pthread_cond_wait(&site->cv, &site->mu);
  }
  pthread_mutex_unlock(&site->mu);
}

#define REDUCE_CASE(DT, T)                                                                  \
  case DT: {                                                                                \
    T* o = (T*)dst;                                                                         \
    for (int k = 0; k < count; ++k) {                                                       \
      const T* a = (const T*)src[k];                                                        \
      if (k == 0) {                                                                         \
        memcpy(o + lo, a + lo, (size_t)(hi - lo) * sizeof(T));                              \
        continue;                                                                           \
      }                                                                                     \
      if (op == 0) for (size_t i = lo; i < hi; ++i) o[i] = o[i] + a[i];                     \
      else if (op == 1) for (size_t i = lo; i < hi; ++i) o[i] = o[i] * a[i];                \
      else if (op == 2) for (size_t i = lo; i < hi; ++i) o[i] = a[i] > o[i] || a[i] != a[i] ? a[i] : o[i];  \
      else for (size_t i = lo; i < hi; ++i) o[i] = a[i] < o[i] || a[i] != a[i] ? a[i] : o[i];               \
    }                                                                                       \
    return 1;                                                                               \
  }

/* dst[lo:hi] = src[0][lo:hi] op ... op src[count-1][lo:hi], in local slot order (0: the dtype is not handled);
 * max and min keep a NaN, as np.maximum and XLA do. */
static int reduce_local(XLA_FFI_DataType dtype, int64_t op, void* dst, const void* const* src, int count, size_t lo,
                        size_t hi) {
  switch (dtype) {
    REDUCE_CASE(XLA_FFI_DataType_F32, float)
    REDUCE_CASE(XLA_FFI_DataType_F64, double)
    REDUCE_CASE(XLA_FFI_DataType_S8, int8_t)
    REDUCE_CASE(XLA_FFI_DataType_U8, uint8_t)
    REDUCE_CASE(XLA_FFI_DataType_S16, int16_t)
    REDUCE_CASE(XLA_FFI_DataType_U16, uint16_t)
    REDUCE_CASE(XLA_FFI_DataType_S32, int32_t)
    REDUCE_CASE(XLA_FFI_DataType_U32, uint32_t)
    REDUCE_CASE(XLA_FFI_DataType_S64, int64_t)
    REDUCE_CASE(XLA_FFI_DataType_U64, uint64_t)
    default: return 0;
  }
}

/* The mesh position of this thread's device (the first operand of calls on several devices of a process). */
static int64_t position(const XLA_FFI_CallFrame* frame) {
  return *(const int32_t*)((const XLA_FFI_Buffer*)frame->args.args[0])->data;
}

/* The site of a call on several devices of this process (attributes ``site`` and ``local``, the mesh positions of
 * the process's devices), this thread's ``slot`` in it (the index of its position, the first operand, among them)
 * and the ``count`` of devices that meet there; NULL when the call lacks them or this device is not among them. */
static Site* local_site(const XLA_FFI_CallFrame* frame, int* slot, int* count) {
  int64_t id = 0;
  size_t n = 0;
  const int64_t* local = array(frame, "local", &n);
  if (local == NULL || n > MAX_LOCAL || !scalar(frame, "site", &id)) return NULL;
  *slot = -1;
  for (size_t i = 0; i < n; ++i)
    if (local[i] == position(frame)) *slot = (int)i;
  *count = (int)n;
  return *slot < 0 ? NULL : site_of(id);
}

/* Reduce the local devices' inputs into the leader's output (each thread a slice), one MPI_Allreduce in place
 * across processes, then every other thread copies the result into its own output. (One MPI_Allreduce per thread,
 * each of its slice on a communicator of its own, all at once, took 3x longer on 2 cores: 8 threads polling.) */
static XLA_FFI_Error* allreduce_local(const XLA_FFI_CallFrame* frame, MPI_Comm comm) {
  const XLA_FFI_Buffer* x = (const XLA_FFI_Buffer*)frame->args.args[1];
  XLA_FFI_Buffer* out = (XLA_FFI_Buffer*)frame->rets.rets[0];
  int64_t op = 0;
  int slot = -1, n = 0;
  Site* site = local_site(frame, &slot, &n);
  MPI_Datatype type = reduce_type(x->dtype);
  if (site == NULL || !scalar(frame, "op", &op) || type == MPI_DATATYPE_NULL)
    return fail(frame, "shardax MPI transport: allreduce outside its site (or without its op)");
  size_t len = elements(x), bytes = len * dtype_bytes(x->dtype);
  site->in[slot] = x->data;
  site->out[slot] = out->data;
  meet(site, n);
  size_t lo = len * (size_t)slot / (size_t)n, hi = len * (size_t)(slot + 1) / (size_t)n;
  reduce_local(x->dtype, op, site->out[0], site->in, n, lo, hi);
  meet(site, n);
  if (slot == 0) {
    MPI_Op mop = op == 0 ? MPI_SUM : op == 1 ? MPI_PROD : op == 2 ? MPI_MAX : MPI_MIN;
    site->status = len > INT32_MAX ? MPI_ERR_COUNT : MPI_Allreduce(MPI_IN_PLACE, out->data, (int)len, type, mop, comm);
  }
  meet(site, n);
  int status = site->status;
  if (slot != 0 && status == MPI_SUCCESS) memcpy(out->data, site->out[0], bytes);
  meet(site, n);  /* the leader's output is read until here */
  return status == MPI_SUCCESS ? NULL : mpi_fail(frame, "MPI_Allreduce", status);
}

/* One message of the leader's MPI_Alltoallw: the blocks for (or from) one process, as an MPI type of absolute
 * addresses in the devices' buffers. */
typedef struct {
  int n, cap;
  int* len;
  MPI_Aint* at;
} Blocks;

static int add_block(Blocks* b, const void* address, int64_t bytes) {
  if (bytes <= 0) return 0;
  if (bytes > INT32_MAX) return 1;
  if (b->n == b->cap) {
    int cap = b->cap ? 2 * b->cap : 16;
    int* len = (int*)realloc(b->len, (size_t)cap * sizeof(int));
    if (len == NULL) return 1;
    b->len = len;
    MPI_Aint* at = (MPI_Aint*)realloc(b->at, (size_t)cap * sizeof(MPI_Aint));
    if (at == NULL) return 1;
    b->at = at;
    b->cap = cap;
  }
  MPI_Get_address(address, &b->at[b->n]);
  b->len[b->n++] = (int)bytes;
  return 0;
}

/* Rows between every device of the run: the leader learns every count (one MPI_Allgather of this process's
 * counts), moves what crosses processes with one MPI_Alltoallw between the devices' own buffers, and each thread
 * copies the rows that come from devices of its own process. Same layout and truncation as kind 1. */
static XLA_FFI_Error* ragged_local(const XLA_FFI_CallFrame* frame, MPI_Comm comm) {
  int64_t fixed = 0;  /* > 0: an all_to_all of ``fixed`` rows per rank pair (no counts in, none out) */
  if (!scalar(frame, "fixed", &fixed)) fixed = 0;
  const XLA_FFI_Buffer* x = (const XLA_FFI_Buffer*)frame->args.args[1];
  const XLA_FFI_Buffer* counts_in = fixed ? NULL : (const XLA_FFI_Buffer*)frame->args.args[2];
  XLA_FFI_Buffer* data = (XLA_FFI_Buffer*)frame->rets.rets[0];
  XLA_FFI_Buffer* got = fixed ? NULL : (XLA_FFI_Buffer*)frame->rets.rets[1];
  size_t ndev = 0, nslots = 0, size = 0;
  const int64_t* procs = array(frame, "procs", &ndev);
  const int64_t* slots = array(frame, "slots", &nslots);
  const int64_t* members = array(frame, "members", &size);
  if (procs == NULL || slots == NULL || members == NULL || nslots != ndev)
    return fail(frame, "shardax MPI transport: alltoallv without its plan");
  int slot = -1, n = 0;
  Site* site = local_site(frame, &slot, &n);
  if (site == NULL) return fail(frame, "shardax MPI transport: alltoallv outside its site");
  int nprocs = 0, me = 0;
  MPI_Comm_size(comm, &nprocs);
  MPI_Comm_rank(comm, &me);
  int64_t rows = x->rank > 0 ? x->dims[0] : 0;
  int64_t capacity = data->rank > 0 ? data->dims[0] : 0;
  size_t rb = capacity > 0 ? elements(data) / (size_t)capacity * dtype_bytes(data->dtype) : 0;
  site->in[slot] = x->data;
  site->out[slot] = data->data;
  site->counts[slot] = fixed ? NULL : (const int32_t*)counts_in->data;
  meet(site, n);
  /* The leader's plan, kept across the barrier that publishes it. */
  int64_t *mine = NULL, *every = NULL, *table = NULL, *start = NULL, *at = NULL;
  Blocks *send = NULL, *recv = NULL;
  if (slot == 0) {  /* the leader: every count, and the blocks of what crosses processes */
    int status = MPI_SUCCESS;
    mine = (int64_t*)malloc((size_t)n * size * sizeof(int64_t));
    every = (int64_t*)malloc((size_t)nprocs * n * size * sizeof(int64_t));
    table = (int64_t*)malloc(ndev * size * sizeof(int64_t));
    start = (int64_t*)malloc((size_t)n * size * sizeof(int64_t));  /* where slot k's rows to r start */
    at = (int64_t*)calloc(ndev, sizeof(int64_t));                  /* rows placed in each position */
    send = (Blocks*)calloc((size_t)nprocs, sizeof(Blocks));
    recv = (Blocks*)calloc((size_t)nprocs, sizeof(Blocks));
    if (!mine || !every || !table || !start || !at || !send || !recv) status = MPI_ERR_NO_MEM;
    for (int k = 0; status == MPI_SUCCESS && k < n; ++k) {
      int64_t end = 0;
      for (size_t r = 0; r < size; ++r) {
        int64_t c = fixed ? fixed : site->counts[k][r] > 0 ? site->counts[k][r] : 0;
        int64_t stop = end + c < rows ? end + c : rows;
        mine[(size_t)k * size + r] = stop - end;
        start[(size_t)k * size + r] = end;
        end = stop;
      }
    }
    if (status == MPI_SUCCESS && !fixed)  /* (an all_to_all's counts are known) */
      status = MPI_Allgather(mine, n * (int)size, MPI_INT64_T, every, n * (int)size, MPI_INT64_T, comm);
    if (status == MPI_SUCCESS) {
      for (size_t s = 0; s < ndev; ++s)
        for (size_t r = 0; r < size; ++r)
          table[s * size + r] = fixed ? fixed : every[((size_t)procs[s] * n + (size_t)slots[s]) * size + r];
      /* The blocks of every message, in one order on both ends: destination positions ascending, then sources in
       * group rank order; each cut at the destination's capacity. */
      for (size_t rt = 0; rt < size && status == MPI_SUCCESS; ++rt) {
        size_t t = (size_t)members[rt];
        for (size_t r = 0; r < size; ++r) {
          size_t s = (size_t)members[r];
          int64_t c = table[s * size + rt];
          int64_t keep = capacity - at[t] < c ? capacity - at[t] : c;
          keep = keep > 0 ? keep : 0;
          int p = (int)procs[s], q = (int)procs[t];
          if (keep > 0 && p != q) {
            if (p == me) {
              const char* base = (const char*)site->in[slots[s]];
              if (add_block(&send[q], base + start[(size_t)slots[s] * size + rt] * rb, keep * (int64_t)rb))
                status = MPI_ERR_NO_MEM;
            }
            if (q == me) {
              char* base = (char*)site->out[slots[t]];
              if (add_block(&recv[p], base + at[t] * rb, keep * (int64_t)rb)) status = MPI_ERR_NO_MEM;
            }
          }
          at[t] += keep;
        }
      }
    }
    site->table = table;
    site->status = status;
  }
  meet(site, n);  /* the table is known: the leader moves what crosses processes, then every thread its own rows */
  int status = site->status;
  if (slot == 0) {
    int moved = status;
    if (moved == MPI_SUCCESS) {
      int* sc = (int*)calloc((size_t)nprocs * 4, sizeof(int));
      MPI_Datatype* types = (MPI_Datatype*)malloc((size_t)nprocs * 2 * sizeof(MPI_Datatype));
      if (sc == NULL || types == NULL) moved = MPI_ERR_NO_MEM;
      for (int p = 0; types != NULL && p < 2 * nprocs; ++p) types[p] = MPI_BYTE;
      for (int p = 0; moved == MPI_SUCCESS && p < nprocs; ++p) {
        if (send[p].n) {
          MPI_Type_create_hindexed(send[p].n, send[p].len, send[p].at, MPI_BYTE, &types[p]);
          MPI_Type_commit(&types[p]);
          sc[p] = 1;
        }
        if (recv[p].n) {
          MPI_Type_create_hindexed(recv[p].n, recv[p].len, recv[p].at, MPI_BYTE, &types[nprocs + p]);
          MPI_Type_commit(&types[nprocs + p]);
          sc[2 * nprocs + p] = 1;
        }
      }
      if (moved == MPI_SUCCESS)
        moved = MPI_Alltoallw(MPI_BOTTOM, sc, sc + nprocs, types, MPI_BOTTOM, sc + 2 * nprocs, sc + 3 * nprocs,
                              types + nprocs, comm);
      for (int p = 0; types != NULL && p < 2 * nprocs; ++p)
        if (types[p] != MPI_BYTE) MPI_Type_free(&types[p]);
      free(sc);
      free(types);
    }
    for (int p = 0; send != NULL && recv != NULL && p < nprocs; ++p) {
      free(send[p].len); free(send[p].at); free(recv[p].len); free(recv[p].at);
    }
    free(send); free(recv); free(mine); free(every); free(start); free(at);
    site->moved = moved;
  }
  meet(site, n);  /* the leader's MPI call is done (overlapping it with the copies below was no faster) */
  if (status == MPI_SUCCESS) {  /* rows from devices of this process, and the counts */
    const int64_t* table = site->table;
    size_t t = (size_t)position(frame), rt = 0;
    for (size_t r = 0; r < size; ++r)
      if ((size_t)members[r] == t) rt = r;
    int32_t* out_counts = fixed ? NULL : (int32_t*)got->data;
    int64_t at = 0;
    for (size_t r = 0; r < size; ++r) {
      size_t s = (size_t)members[r];
      int64_t c = table[s * size + rt];
      if (out_counts != NULL) out_counts[r] = (int32_t)c;
      int64_t keep = capacity - at < c ? capacity - at : c;
      keep = keep > 0 ? keep : 0;
      if (keep > 0 && procs[s] == procs[t]) {
        const int32_t* want = site->counts[slots[s]];
        int64_t first = fixed * (int64_t)rt;  /* where s's rows to rt start: the clipped counts before rt */
        for (size_t k = 0; want != NULL && k < rt; ++k) first += want[k] > 0 ? want[k] : 0;
        first = first < rows ? first : rows;
        memcpy((char*)data->data + at * rb, (const char*)site->in[slots[s]] + first * rb, (size_t)(keep * (int64_t)rb));
      }
      at += keep;
    }
    if (at < capacity) memset((char*)data->data + at * rb, 0, (size_t)(capacity - at) * rb);
  }
  meet(site, n);  /* inputs and the table are read, and the MPI call is done, until here */
  if (status == MPI_SUCCESS) status = site->moved;
  if (slot == 0) {
    free(site->table);
    site->table = NULL;
  }
  return status == MPI_SUCCESS ? NULL : mpi_fail(frame, "the alltoallv's MPI calls", status);
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
  if (kind == 3) return allreduce_local(frame, comm);
  if (kind == 4) return ragged_local(frame, comm);
  return fail(frame, "shardax MPI transport: unknown collective");
}
