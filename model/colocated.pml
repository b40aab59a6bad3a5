/* The protocol with leases and results in one PostgreSQL database: spin -a model/colocated.pml */
#define COLOCATED 1
#include "bounds.pml"
#if MAX_DATALOSS > 0
#error "the failover fault is Redis's: etcd and the SQL leases keep every acknowledged write"
#endif
#include "state.pml"
#include "props.pml"
#include "grant.pml"
#include "store_colocated.pml"
#include "results.pml"
#include "worker.pml"
#include "env.pml"
