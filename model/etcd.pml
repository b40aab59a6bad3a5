/* The protocol with etcd leases, SQL results: spin -a model/etcd.pml */
#define ETCD 1
#include "bounds.pml"
#if MAX_DATALOSS > 0
#error "the failover fault is Redis's: etcd and the SQL leases keep every acknowledged write"
#endif
#include "state.pml"
#include "props.pml"
#include "grant.pml"
#include "store_etcd.pml"
#include "results.pml"
#include "worker.pml"
#include "env.pml"
