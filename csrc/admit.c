/*
 * admit.c - see admit.h.
 */
#include "admit.h"

bool
cqc_admission_valid (const cqc_arena_t *a, const cqc_admission_t *adm)
{
   uint64_t id_hash;
   uint32_t cell = CQC_NO_CELL;

   if (adm->token.ns_idx >= a->geo.ns_count || adm->token.db_idx >= a->geo.db_count ||
       (adm->not_found && adm->vlen)) {
      return false;
   }
   if (cqc_filter_identity (adm->filter, adm->flen, &id_hash)) {
      cell = cqc_id_cell (id_hash, adm->token.ns_idx, a->geo.idgen_count);
   }
   return cell == adm->token.id_cell;
}

cqc_key_status_t
cqc_admission_key (const cqc_admission_t *adm, cqc_key_t *key)
{
   return cqc_key_build (key, (uint8_t) (adm->kind & ~CQC_KIND_REBIND), adm->token.ns_idx,
                         adm->filter, adm->flen, adm->rest, adm->rlen);
}

int
cqc_admit (const cqc_writer_t *w, const cqc_admission_t *adm, uint64_t *key_hash)
{
   cqc_token_t tok = adm->token;
   cqc_key_t key;
   int r;

   if (!cqc_admission_valid (w->arena, adm)) {
      return CQC_ADMIT_INVALID;
   }
   switch (cqc_admission_key (adm, &key)) {
   case CQC_KEY_OK:
      break;
   case CQC_KEY_TOO_LARGE:
      return CQC_ADMIT_TOO_LARGE;
   default:
      return CQC_ADMIT_NO_MEMORY;
   }
   *key_hash = cqc_hash_bytes (key.buf, key.len, 0);
   pthread_mutex_lock (w->lock);
   if ((adm->kind & CQC_KIND_REBIND) && !adm->not_found) {
      cqc_arena_w_rebind (w->arena, &tok, adm->value, adm->vlen);
   }
   r = cqc_arena_w_admit (w->arena, &tok, *key_hash, key.buf, key.len,
                          adm->not_found ? NULL : adm->value, adm->not_found ? 0 : adm->vlen,
                          adm->not_found ? CQC_ENTRY_NOT_FOUND : 0);
   pthread_mutex_unlock (w->lock);
   cqc_key_free (&key);
   return r;
}
